"""Prometheus text of several replicas as one: every sample labelled with
its replica, then each family's samples gathered under one HELP and TYPE."""

from __future__ import annotations


def merged(texts: list[str]) -> str:
    """Prometheus texts of the same families as one: each family's HELP and TYPE once, then every text's
    samples of it (a parser refuses a family whose lines are split, or a second TYPE line)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                head, _ = families.setdefault(family, ([], []))
                if line not in head:
                    head.append(line)
            elif line and not line.startswith("#"):
                families.setdefault(family, ([], []))[1].append(line)
    return "".join("\n".join(head + samples) + "\n" for head, samples in families.values())


def labelled(text: str, index: int) -> str:
    """Prometheus text with `replica="index"` on every sample (comments and blank lines kept)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        name, sep, rest = line.partition(" ")
        if "{" in name:
            head, _, labels = name.partition("{")
            name = f'{head}{{replica="{index}",{labels}'
        else:
            name = f'{name}{{replica="{index}"}}'
        out.append(name + sep + rest)
    return "\n".join(out) + "\n"
