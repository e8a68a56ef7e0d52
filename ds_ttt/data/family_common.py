"""The material every task family's world is made of: its words, its service names, random names, lines and hex.

    from .family_common import SERVICES, random_hex, random_lines, random_name
    svc = rng.choice(SERVICES)                        # "api", "billing", ...
    ep.write("logs/boot.log", random_lines(rng, 3, "boot: "))   # "boot: cedar onyx 412\\n" x 3
    token = random_hex(rng, 12)

Shared by the families (families.py, shell_families.py) and the closed-loop task kinds
(ds_ttt/tasks/kinds.py), which build the same worlds. It imports none of them, so they import it and
not each other's helpers (tests/unit/test_import_graph.py keeps ds_ttt/data/ free of import cycles).
Everything here draws from the caller's `random.Random`, so a seed reproduces the same bytes.
"""

from __future__ import annotations

import random

WORDS = (
    "alpha bravo cedar delta ember falcon garnet harbor indigo juniper kestrel lumen maple nimbus onyx "
    "pepper quartz raven sierra tundra umber violet willow xenon yarrow zephyr amber basil cobalt dune"
).split()
SERVICES = "api worker gateway billing auth search metrics scheduler notifier ingest".split()


def random_name(rng: random.Random) -> str:
    return rng.choice(WORDS)


def random_hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def random_lines(rng: random.Random, n: int, prefix: str = "") -> str:
    return "".join(f"{prefix}{random_name(rng)} {random_name(rng)} {rng.randint(1, 999)}\n" for _ in range(n))
