"""Tenant commands for users root allows (issue 45): `user.zonefs.tenant` on a directory
(control.py), the `tenant_admins=` mount option (daemon/options.py). Engine tests mount an
emulated image (no FUSE) and end with fsck."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import CTX, mounted, resolve

from zonefs_py import control, errors
from zonefs_py.daemon import options
from zonefs_py.daemon.options import MountConfig, MountError, parse_tenant_admins
from zonefs_py.fs.api import Ctx

ALICE = Ctx(uid=1000, gid=1000, pid=0, umask=0)
BOB = Ctx(uid=1001, gid=1001, pid=0, umask=0, groups=(500,))
CAROL = Ctx(uid=1002, gid=1002, pid=0, umask=0)


def test_delegates_are_root_listed_users_and_members_of_listed_groups() -> None:
    nobody = control.TenantDelegates()
    assert nobody.allows(CTX)
    assert not nobody.allows(ALICE)
    some = control.TenantDelegates(frozenset({1000}), frozenset({500}))
    assert some.allows(ALICE)
    assert some.allows(BOB)  # a supplementary group
    assert not some.allows(CAROL)
    assert some.allows(Ctx(uid=1003, gid=500, pid=0, umask=0))  # the primary group
    assert some.status() == {"uids": [1000], "gids": [500]}


async def test_a_delegate_declares_changes_and_removes_a_tenant(tmp_path: Path) -> None:
    delegates = control.TenantDelegates(frozenset({1000}))
    control.LAST_TENANT_ERROR.clear()
    async with mounted(tmp_path / "fs.img", create=True) as fs:
        root = await resolve(fs, "/")
        d = (await fs.mkdir(root, b"team", 0o755, CTX)).ino
        await control.tenant_xattr_set(fs, d, b"add 1 4 2", ALICE, delegates)
        policy = fs.state.tenants.by_id[fs.state.tenants.by_dir[d]]
        assert (policy.min_zones, policy.max_zones, policy.max_active) == (1, 4, 2)
        await control.tenant_xattr_set(fs, d, b"set - 6 -\n", ALICE, delegates)
        policy = fs.state.tenants.by_id[fs.state.tenants.by_dir[d]]
        assert (policy.min_zones, policy.max_zones, policy.max_active) == (1, 6, 2)
        doc = json.loads(control.tenant_xattr_get(fs, d, ALICE, delegates))
        assert doc["tenant"]["zones_max"] == 6
        assert doc["may_change"]
        assert doc["last_error"] is None
        # Someone root did not name: refused, and told why.
        with pytest.raises(errors.NotPermitted, match="tenant_admins="):
            await control.tenant_xattr_set(fs, d, b"remove", CAROL, delegates)
        doc = json.loads(control.tenant_xattr_get(fs, d, CAROL, delegates))
        assert not doc["may_change"]
        assert "uid 1002 may not declare or change tenants" in doc["last_error"]
        assert doc["tenant"]["tenant_id"] == policy.tenant_id  # reading is open
        # A delegate's own mistakes are its own to read.
        with pytest.raises(errors.InvalidArgument, match="write 'add MIN MAX"):
            await control.tenant_xattr_set(fs, d, b"declare", ALICE, delegates)
        with pytest.raises(errors.Exists):
            await control.tenant_xattr_set(fs, d, b"add 0 0", ALICE, delegates)
        assert "tenant already" in json.loads(
            control.tenant_xattr_get(fs, d, ALICE, delegates))["last_error"]
        await control.tenant_xattr_set(fs, d, b"remove", ALICE, delegates)
        assert not fs.state.tenants
        assert json.loads(control.tenant_xattr_get(fs, d, ALICE, delegates)) == {
            "tenant": None, "may_change": True, "last_error": None}
        # Root needs no delegation.
        await control.tenant_xattr_set(fs, d, b"add 0 3", CTX, control.TenantDelegates())
        assert fs.state.tenants


def test_tenant_admins_option_parses_users_and_groups(tmp_path: Path) -> None:
    assert parse_tenant_admins("1000:@500:root:@root") == (frozenset({1000, 0}),
                                                           frozenset({500, 0}))
    with pytest.raises(MountError, match="no such user"):
        parse_tenant_admins("no-such-user-zfs")
    with pytest.raises(MountError, match="no such group"):
        parse_tenant_admins("@no-such-group-zfs")
    with pytest.raises(MountError, match="empty entry"):
        parse_tenant_admins("1000::2")
    dev = tmp_path / "d.img"
    dev.write_bytes(b"")
    cfg = MountConfig.build(str(dev), str(tmp_path), ["tenant_admins=1000:@500"])
    assert (cfg.tenant_admin_uids, cfg.tenant_admin_gids) == (frozenset({1000}),
                                                              frozenset({500}))
    assert MountConfig.build(str(dev), str(tmp_path), []).tenant_admin_uids == frozenset()


def test_only_a_mount_by_root_may_delegate(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dev = tmp_path / "d.img"
    dev.write_bytes(b"")
    monkeypatch.setattr(options.os, "geteuid", lambda: 1000)
    with pytest.raises(MountError, match="only root may let others"):
        MountConfig.build(str(dev), str(tmp_path), ["tenant_admins=1000"])
    MountConfig.build(str(dev), str(tmp_path), [])
