"""One contract every registered KVStore type passes (tests/store/kvstore_contract.py): tfkv's
own types, the dist_* ones as a worker of a real job (scheduler, server, worker processes on
127.0.0.1), and a plug-in type registered here, as a new type would be. A type registered in
`tfkv.store` is in the contract without a line added here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import kvstore_contract as contract
from tfkv import store
from tfkv.store.local import LocalStore


class EchoStore(LocalStore):
    """A plug-in type of a test's own: the local store under another name."""

    type = "contract_echo"


@pytest.fixture(scope="module", autouse=True)
def echo_type():
    store.register("contract_echo", f"{__name__}:EchoStore")
    yield
    store.REGISTRY.unregister("contract_echo")


def _types() -> list[str]:
    store.register("contract_echo", f"{__name__}:EchoStore")  # collected before the fixture runs
    try:
        return store.names()
    finally:
        store.REGISTRY.unregister("contract_echo")


DEVICES = 2


def _check(seen: dict, kind: str) -> None:
    can = store.capabilities(kind)
    want = contract.expected(can.sync, DEVICES)
    got = {k: seen.get(k) for k in want}
    assert got == want, json.dumps(seen, indent=1)
    assert seen["type"] == kind
    assert seen["unknown_capability"].startswith("ValueError: unknown capability 'teleport'")
    assert seen["init_twice"].startswith("ValueError: ") and "already initialised" in seen["init_twice"]
    assert seen["unknown_key"].startswith("KeyError: ") and "99" in seen["unknown_key"]
    assert seen["mixed_key"].startswith("ValueError: key 'w' is a str, but this store's keys are ints")
    assert seen["float_key"].startswith("TypeError: key 1.5 is a float; a KVStore key is an int or a str")
    assert seen["save_without_optimizer"].startswith("RuntimeError: ") and "optimizer" in seen["save_without_optimizer"]
    assert "3/momentum" in seen["state_keys"], seen["state_keys"]  # the key pushed with the optimizer
    assert seen["load_missing"] is not None
    for name in contract.HALF:  # one line naming the key and both dtypes
        assert seen[f"{name}_f32_push"].startswith(f"ValueError: push of key {51 + 2 * contract.HALF.index(name)}: "
                                                   f"a float32 value for a {name} key"), seen[f"{name}_f32_push"]
    if not can.sync:  # servers apply each push as it comes: without an optimizer it would overwrite
        assert seen["without_optimizer"].startswith(f"RuntimeError: {kind} needs an optimizer on the servers")


@pytest.mark.parametrize("kind", _types())
def test_every_store_type_keeps_the_contract(kind, cluster, tf_devices, tmp_path):
    if not store.capabilities(kind).distributed:
        kv = store.create(kind, devices=tf_devices[:DEVICES])
        _check(contract.run(kv, DEVICES, str(tmp_path)), kind)
        return
    c = cluster(num_servers=1, num_workers=1)
    c.start_servers()
    out = tmp_path / "contract.json"
    c.start("worker 0", "worker", [sys.executable, str(Path(contract.__file__)), str(out)], TFKV_RANK_HINT="0",
            TEST_KVSTORE=kind, TEST_DEVICES=str(DEVICES))
    codes = c.wait(120)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"
    _check(json.loads(out.read_text()), kind)


def test_the_contract_covers_every_registered_type_and_the_plug_in():
    assert {"local", "device", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device",
            "contract_echo"} <= set(_types())


def test_half_precision_cases_are_ones_that_can_fail():
    """The contract's half-precision expectations tell the two updates apart: without
    multi_precision each step is lost in half (the weight stays 1), with it the float32 master
    moves the weight."""
    for name in contract.HALF:
        assert contract.sgd_reference(name, False) == [1.0, 1.0]
        assert contract.sgd_reference(name, True)[0] < 1.0
