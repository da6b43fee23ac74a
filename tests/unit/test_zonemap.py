"""The zone map by tenant (issue 45): `zone_tenants` in the status document (fs/status.py),
the terminal grid and the PNG drawn from it (zonemap.py), and `stat --by-tenant`'s flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from engine_helpers import CTX, MiB, mounted, pattern, resolve, write_file

from zonefs_py import zonemap
from zonefs_py.cli import stat as stat_cli
from zonefs_py.fs.status import TENANT_CHAR_MORE, TENANT_CHARS

DOC = {"zone_map": "SSMm..dDxdD", "zone_streams": "------cdlff", "zone_live": "------5X0X9",
       "zone_tenants": "------.AAB.", "zone_tenant_legend": {"A": "ckpt", "B": "jobs/data"}}


async def test_status_names_the_tenant_of_each_data_zone(tmp_path: Path) -> None:
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        plain = fs.status()
        assert "zone_tenants" not in plain  # nothing declared: the document is unchanged
        root = await resolve(fs, "/")
        a = (await fs.mkdir(root, b"ckpt", 0o755, CTX)).ino
        jobs = (await fs.mkdir(root, b"jobs", 0o755, CTX)).ino
        b = (await fs.mkdir(jobs, b"data", 0o755, CTX)).ino
        ta = fs.tenants.declare(a, 0, 0)
        tb = fs.tenants.declare(b, 0, 0)
        await write_file(fs, "/ckpt/x", pattern(1, 3 * MiB))
        await write_file(fs, "/jobs/data/y", pattern(2, 1 * MiB))
        await write_file(fs, "/shared", pattern(3, 1 * MiB))
        doc = fs.status()
        owners = doc["zone_tenants"]
        assert isinstance(owners, str)
        assert len(owners) == len(doc["zone_map"]) == len(doc["zone_streams"])
        assert doc["zone_tenant_legend"] == {"A": "ckpt", "B": "jobs/data"}
        for zone, tid in fs.state.zone_tenant.items():
            assert owners[zone] == {ta: "A", tb: "B"}[tid]
        assert {owners[i] for i, ch in enumerate(doc["zone_streams"]) if ch == "-"
                and doc["zone_map"][i] not in ".x"} <= {"-", "."}
        assert owners.count("A") == len(fs.alloc.tenant_zones(ta)) >= 2
        assert owners.count("B") == len(fs.alloc.tenant_zones(tb)) >= 1
        assert "." in {owners[i] for i, ch in enumerate(doc["zone_map"]) if ch in "dD"}


def test_tenant_characters_run_out_into_one_for_the_rest() -> None:
    assert len(set(TENANT_CHARS)) == len(TENANT_CHARS) == 55
    assert TENANT_CHAR_MORE not in TENANT_CHARS + ".-"
    assert not set(TENANT_CHARS) & set("SSMm.dDx!c")  # the zone map's own characters


def test_grid_by_tenant_plain_and_coloured() -> None:
    assert zonemap.grid(DOC, colour=False) == ["SSMm..dDxdD"]
    assert zonemap.grid(DOC, colour=False, by_tenant=True) == ["SSMm..dAABD"]
    coloured = "".join(zonemap.grid(DOC, colour=True, by_tenant=True))
    assert "\x1b[32;1mA" in coloured
    assert "\x1b[33;1mB" in coloured
    legend = zonemap.grid_legend(False, DOC, by_tenant=True)
    assert legend.startswith("zones by tenant: A ckpt, B jobs/data")
    assert "\x1b[32;1mA\x1b[0m ckpt" in zonemap.grid_legend(True, DOC, by_tenant=True)
    # No tenant declared (an older daemon, or none): every data zone is nobody's.
    bare = {k: v for k, v in DOC.items() if not k.startswith("zone_tenant")}
    assert zonemap.grid(bare, colour=False, by_tenant=True) == ["SSMm..dDxdD"]
    assert "no tenant declared" in zonemap.grid_legend(False, bare, by_tenant=True)
    # Run-length encoded (past 8192 zones): printed as it is.
    encoded = {"zone_map": "S2 D9000", "zone_tenants": ""}
    assert zonemap.grid(encoded, colour=False, by_tenant=True) == ["S2 D9000"]


def test_render_all_by_tenant() -> None:
    text = stat_cli.render(dict(DOC), by_tenant=True)
    assert "SSMm..dAABD" in text
    assert "zones by tenant: A ckpt, B jobs/data" in text
    assert "zone_tenant" not in text  # drawn, not listed
    assert "Zone tenant" not in text


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stat_cli.register(parser.add_subparsers())
    return parser.parse_args(["stat", "/mnt", *argv])


def test_by_tenant_needs_a_zone_map() -> None:
    assert "--by-tenant" in (stat_cli.check_flags(_args("--by-tenant")) or "")
    assert "--by-tenant" in (stat_cli.check_flags(_args("--by-tenant", "--json")) or "")
    assert stat_cli.check_flags(_args("--by-tenant", "--all")) is None


def test_png_by_tenant(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the [plot] extra is not installed")
    for by_tenant in (False, True):
        out = tmp_path / f"z{by_tenant}.png"
        zonemap.save_png(dict(DOC), str(out), by_tenant=by_tenant)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert zonemap.tenant_colour("A", DOC["zone_tenant_legend"]) == zonemap.TENANT_COLOURS[0]
    assert zonemap.tenant_colour(".", DOC["zone_tenant_legend"]) == zonemap.SHARED_COLOUR
    # Tenant colours differ from each other and from shared data.
    a, b = (zonemap._cell_colour("D", "f", "X", zonemap.tenant_colour(c, DOC["zone_tenant_legend"]))
            for c in "AB")
    assert a != b
