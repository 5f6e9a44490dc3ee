"""Data moving between places: the tensor store behind walk edges, the
shared host arena, host-to-device copies that never wait, device-to-device
transport, and helper processes. Knows no other room of the engine."""
