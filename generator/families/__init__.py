"""Kernel families: what each one's templates need from a descriptor, and which variants it takes.

One module per family (portable, hopper) declares it; base.py holds the interface and what
they share. FAMILIES is the table the spec loader, the renderer and the build look families up in.
"""
from __future__ import annotations

from .base import Family
from .hopper import HopperFamily
from .portable import PortableFamily

FAMILIES: dict[str, Family] = {f.name: f for f in (PortableFamily(), HopperFamily())}
