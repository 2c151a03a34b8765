"""pytest plugin: run the device tests on a remote device through a TVM RPC tracker.

    pytest --rpc-tracker HOST:PORT --rpc-key KEY

Tests that run compiled models take the `on_device` fixture: it returns the model itself
without the options, and the model uploaded to a device of that key with them.
"""

from __future__ import annotations

import pytest

from gimlet_tvm.runtime.remote import RemoteDevice


def pytest_addoption(parser) -> None:
    group = parser.getgroup("gimlet-tvm remote device")
    group.addoption("--rpc-tracker", metavar="HOST:PORT", help="run device tests via this tracker")
    group.addoption("--rpc-key", metavar="KEY", help="device key to request from the tracker")


@pytest.fixture(scope="session")
def remote_device(request) -> RemoteDevice | None:
    tracker = request.config.getoption("--rpc-tracker")
    if tracker is None:
        return None
    return RemoteDevice(tracker=tracker, key=request.config.getoption("--rpc-key"))


@pytest.fixture
def on_device(remote_device):
    """`on_device(model)`: where the device tests run the model (locally or remotely)."""
    return (lambda model: model) if remote_device is None else (lambda m: m.remote(remote_device))
