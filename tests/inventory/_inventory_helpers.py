"""What the InventoryService RPC tests (test_inventory_service.py, test_inventory_reservations.py)
share: registering the fixture worker, listing device ids, and a device claim."""

from __future__ import annotations

from accelmesh.inventory.v1 import inventory_service_pb2 as pb

GB = 10**9


def register(stub, worker):
    return stub.RegisterNode(pb.RegisterNodeRequest(address=f"127.0.0.1:{worker.port}"))


def device_ids(stub, filter_text=""):
    return [d.id for d in stub.ListDevices(pb.ListDevicesRequest(filter=filter_text)).devices]


def claim(device="127.0.0.1/cuda:0", memory=10 * GB, compute=0.25):
    return pb.DeviceClaim(device_id=device, memory_bytes=memory, compute_fraction=compute)
