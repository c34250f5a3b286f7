"""The build's compile-cache keys: what invalidates a unit's cubin, and what does not."""
from __future__ import annotations

from pathlib import Path

from flashkiln.generator import toolchain as tc_module
from flashkiln.generator.build import Selection, plan_units
from flashkiln.generator.toolchain import SPECS_DIR, own_headers_digest

_READ_HEADER = tc_module._own_header.__wrapped__  # uncached


def _keys(monkeypatch, edited: str | None = None) -> dict[str, str]:
    """Each default sm_90a unit's first variant -> the unit's cache key, with the header `edited`
    changed by one byte."""
    if edited is not None:
        def with_edit(relative: str):
            text, includes = _READ_HEADER(relative)
            return (text + b" " if relative == edited else text), includes

        monkeypatch.setattr(tc_module, "_own_header", with_edit)
    units = plan_units(Path(SPECS_DIR), Selection(archs=("sm_90a",)))
    return {u.variants[0].descriptor.name: u.key for u in units}


def test_a_header_edit_recompiles_only_the_units_that_include_it(monkeypatch):
    before = _keys(monkeypatch)
    after = _keys(monkeypatch, "flashkiln/hopper/bwd_kernel.hpp")
    changed = {name for name in before if before[name] != after[name]}
    assert changed and all(name.startswith("bwd_hopper_") for name in changed)
    assert changed == {name for name in before if name.startswith("bwd_hopper_")}
    # A header every unit reaches changes every key.
    common = _keys(monkeypatch, "flashkiln/params.hpp")
    assert all(before[name] != common[name] for name in before)


def test_the_headers_a_unit_reaches_include_those_of_its_headers():
    direct = own_headers_digest("#include <flashkiln/hopper/bwd_params.hpp>\n")
    through = own_headers_digest("#include <flashkiln/hopper/fwd_params.hpp>\n#include <flashkiln/hopper/bwd_params.hpp>\n")
    assert direct == through  # bwd_params.hpp includes fwd_params.hpp itself
    assert own_headers_digest("// no flashkiln header\n") != direct
