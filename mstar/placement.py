"""Placement: which devices run each component (or one mode of it), and on
which device each partition of a request runs.

The spec comes from `--placement` (and `--placement-file`): `replicas` (the
default: every device runs every component, and a request stays on one),
`split` (the model's own split, e.g. Orpheus's llm on the first devices and
its codec on the last), or explicit entries `llm=0,codec=1` where a key is a
component or `component.mode`, and a value names devices by their index in
`--gpus` or by name, several joined by `+` (data-parallel replicas:
`llm=0+1,codec=1`). A file holds the same entries as a JSON or YAML mapping
(`{"llm": [0, 1], "codec": 1}`). A component the spec does not name runs on
every device.

`resolve` checks the spec against the model: a KV component's modes share
its pages, so they share devices; every partition of every walk needs a
device that runs all of its steps. `route` picks a device per partition for
one request, keeping the request on as few devices as it can and, among
equals, on the least loaded. A leaf: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mstar.errors import ConfigError
from mstar.graph import Component, WalkPlan

Unit = tuple[str, str]  # (component, mode)


@dataclass(frozen=True)
class PlacementSpec:
    """What the command line asked for, before the model is known."""

    kind: str = "replicas"                                 # replicas | split | explicit
    entries: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (key, device tokens) for explicit


def parse_spec(text: str | None, file: str | None = None) -> PlacementSpec:
    """`--placement` and `--placement-file` into a spec; raises ConfigError."""
    if file:
        if text not in (None, "", "replicas"):
            raise ConfigError("give --placement or --placement-file, not both")
        return PlacementSpec("explicit", tuple(_read_file(Path(file))))
    text = (text or "replicas").strip()
    if text in ("replicas", "split"):
        return PlacementSpec(text)
    entries = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ConfigError(f"--placement: cannot read '{part}'; expected component=device[+device...]")
        entries.append((key.strip(), tuple(v.strip() for v in value.split("+"))))
    if not entries:
        raise ConfigError("--placement: no entry given")
    return PlacementSpec("explicit", tuple(entries))


def _read_file(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--placement-file: cannot read {path}: {e}") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml  # only for YAML files

        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--placement-file: {path} is not valid JSON: {e}") from None
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"--placement-file: {path} must hold a mapping of component -> devices")
    out = []
    for key, value in data.items():
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"--placement-file: '{key}' must name a device or a list of devices")
        out.append((str(key), tuple(str(v) for v in values)))
    return out


@dataclass(frozen=True)
class Placement:
    """The devices of each (component, mode), checked against a model."""

    devices: tuple[str, ...]
    units: dict[Unit, tuple[str, ...]]
    # (walk, partition) -> (the walk's plan, `hosts`): routing asks for every new request's partitions
    _hosts: dict[tuple[str, str], tuple[WalkPlan, tuple[str, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def on(self, device: str) -> dict[str, tuple[str, ...]]:
        """The components `device` runs, each with the modes it runs there."""
        out: dict[str, list[str]] = {}
        for (component, mode), devs in self.units.items():
            if device in devs:
                out.setdefault(component, []).append(mode)
        return {c: tuple(m) for c, m in out.items()}

    def components(self) -> dict[str, tuple[str, ...]]:
        """Each component and the devices that run any of its modes."""
        out: dict[str, list[str]] = {}
        for (component, _), devs in self.units.items():
            have = out.setdefault(component, [])
            have += [d for d in devs if d not in have]
        return {c: tuple(d) for c, d in out.items()}

    def hosts(self, walk: WalkPlan, partition: str) -> tuple[str, ...]:
        """The devices that run every step of `partition`, in --gpus order."""
        kept = self._hosts.get((walk.name, partition))
        if kept is not None and kept[0] is walk:
            return kept[1]
        units = _partition_units(walk, partition)
        hosts = tuple(d for d in self.devices if all(d in self.units[u] for u in units))
        self._hosts[(walk.name, partition)] = (walk, hosts)
        return hosts

    def route(self, walk: WalkPlan, load: Mapping[str, int], root_load: Mapping[str, int] | None = None
              ) -> dict[str, str]:
        """A device for each partition of one request: the root first, on the
        device of least `root_load` (default `load`: the roots each device
        runs, so parts a placement pins to one device do not weigh it down as
        a home for roots), then every other partition on a device already
        chosen where it can run, else the least loaded device that can run it."""
        chosen: dict[str, str] = {}
        order = [walk.root] + [p for p in walk.partitions if p != walk.root]
        for name in order:
            parent = walk.partitions[name].parent
            if parent is not None:  # checked in `resolve`: the parent's device runs the branch
                chosen[name] = chosen[parent]
                continue
            hosts = self.hosts(walk, name)
            used = [d for d in hosts if d in chosen.values()]
            if len(used or hosts) == 1:  # one device to choose (one GPU, or one that runs it): no weighing
                chosen[name] = (used or hosts)[0]
                continue
            weigh = root_load if root_load is not None and name == walk.root else load
            chosen[name] = min(used or hosts, key=lambda d: (weigh.get(d, 0), self.devices.index(d)))
        return chosen


def _partition_units(walk: WalkPlan, partition: str) -> list[Unit]:
    return [(step.component, step.mode) for step in walk.partitions[partition].steps]


def resolve(spec: PlacementSpec, devices: Sequence[str], components: Mapping[str, Component],
            walks: Mapping[str, WalkPlan], split: Mapping[str, Sequence[int]] | None = None) -> Placement:
    """The spec made concrete for a model. `split`: the model's own split
    (component -> device indices) for `--placement split`."""
    devices = tuple(devices)
    every = {(c, m): devices for c, spec_ in components.items() for m in spec_.modes}
    if spec.kind == "replicas":
        return _checked(Placement(devices, every), components, walks)
    if spec.kind == "split":
        if len(devices) < 2:
            raise ConfigError("--placement split needs two devices or more in --gpus")
        if not split:
            raise ConfigError(f"this model has no split placement; name components' devices, e.g. --placement "
                              f"{next(iter(components))}=0 (a component not named runs on every device; its "
                              f"components: {', '.join(components)})")
        entries = [(c, tuple(str(i) for i in idx)) for c, idx in split.items()]
    else:
        entries = list(spec.entries)
    units = dict(every)
    for key, tokens in entries:
        component, _, mode = key.partition(".")
        if component not in components:
            raise ConfigError(f"--placement: unknown component '{component}'; this model has "
                              f"{', '.join(components)}")
        modes = components[component].modes
        if mode and mode not in modes:
            raise ConfigError(f"--placement: component '{component}' has no mode '{mode}' ({', '.join(modes)})")
        devs = tuple(dict.fromkeys(_device(t, devices) for t in tokens))
        for m in ((mode,) if mode else modes):
            units[(component, m)] = devs
    return _checked(Placement(devices, units), components, walks)


def _device(token: str, devices: tuple[str, ...]) -> str:
    """An index into --gpus, or a device named there."""
    if token.isdigit():
        i = int(token)
        if i >= len(devices):
            raise ConfigError(f"--placement: device index {i} is beyond --gpus ({', '.join(devices)})")
        return devices[i]
    if token not in devices:
        raise ConfigError(f"--placement: device '{token}' is not in --gpus ({', '.join(devices)})")
    return token


def _checked(placement: Placement, components: Mapping[str, Component],
             walks: Mapping[str, WalkPlan]) -> Placement:
    for name, spec in components.items():
        if spec.kv_cache and len({placement.units[(name, m)] for m in spec.modes}) > 1:
            raise ConfigError(f"--placement: the modes of '{name}' share its KV cache, so they must run on the "
                              "same devices")
    for walk in walks.values():
        for part, plan in walk.partitions.items():
            hosts = placement.hosts(walk, part)
            if not hosts:
                needs = sorted({f"{c}.{m}" for c, m in _partition_units(walk, part)})
                raise ConfigError(f"--placement: walk '{walk.name}' runs {', '.join(needs)} in one partition "
                                  f"('{part}'), so one device must run all of them")
            # a fan-out branch starts with its parent's values, on its parent's device
            if plan.parent is not None and not set(placement.hosts(walk, plan.parent)) <= set(hosts):
                raise ConfigError(f"--placement: walk '{walk.name}' forks '{part}' from '{plan.parent}', so every "
                                  f"device that runs '{plan.parent}' must run '{part}' too")
    return placement


def describe(placement: Placement) -> dict[str, Any]:
    """For logs and /health: component (or component.mode) -> devices."""
    out: dict[str, Any] = {}
    for component, devs in placement.components().items():
        modes = {m: d for (c, m), d in placement.units.items() if c == component}
        if len(set(modes.values())) == 1:
            out[component] = list(devs)
        else:
            out.update({f"{component}.{m}": list(d) for m, d in modes.items()})
    return out
