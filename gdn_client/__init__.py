"""Python client of gdn-serve, the Gated Delta Net decode service.

>>> import torch
>>> from gdn_client import Client, ClientOptions, GdnError
>>> with Client("127.0.0.1:50051", ClientOptions(timeout=10)) as client:   # doctest: +SKIP
...     info = client.model_info()
...     H, HV, K = info.num_q_heads, info.num_v_heads, info.head_dim_k
...     with client.session() as s:
...         for layer in range(info.num_layers):
...             o = s.decode(layer, torch.randn(1, H, K), torch.randn(1, H, K),
...                          torch.randn(1, HV, K), torch.randn(1, HV), torch.randn(1, HV))

`AsyncClient` is the asyncio twin; `Client.stream()` pipelines steps over DecodeStream;
`Client.shared_memory()` passes tensors by reference to a server on the same host.
All failures raise `GdnError` (``.code`` is the grpc.StatusCode). A host running several server
processes (``gdn-server --processes K``) is reached through its one address: the client sends
each session's calls to the process it lives in. `ReplicaSet` spreads sessions over hosts.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it, imported on first use: a program that uses
# only the error types or options, the stubs (`gdn_client.proto`) or `gdn_client.proto.checks`
# then loads no torch (~2 s of CPU and ~200 MB).
_EXPORTS = {
    "AsyncClient": "_aio", "AsyncSession": "_aio", "AsyncSpeculation": "_aio",
    "Client": "_client", "Session": "_client", "Speculation": "_client",
    "ReplicaSet": "_replicas", "AsyncReplicaSet": "_replicas",
    "SharedMemory": "_shared_memory", "AsyncSharedMemory": "_shared_memory",
    "ExportedState": "_sessions_ext",
    "DeviceInfo": "_info", "ModelInfo": "_info", "Stats": "_info",
    "DeadlineExceededError": "_errors", "FailedPreconditionError": "_errors", "GdnError": "_errors",
    "InvalidArgumentError": "_errors", "NotFoundError": "_errors", "ResourceExhaustedError": "_errors",
    "UnauthenticatedError": "_errors", "UnavailableError": "_errors",
    "ClientOptions": "_options",
    "AsyncDecodeStream": "_stream", "DecodeStream": "_stream",
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the plain imports
    from gdn_client._aio import AsyncClient, AsyncSession, AsyncSpeculation
    from gdn_client._client import Client, Session, Speculation
    from gdn_client._info import DeviceInfo, ModelInfo, Stats
    from gdn_client._errors import (
        DeadlineExceededError,
        FailedPreconditionError,
        GdnError,
        InvalidArgumentError,
        NotFoundError,
        ResourceExhaustedError,
        UnauthenticatedError,
        UnavailableError,
    )
    from gdn_client._options import ClientOptions
    from gdn_client._replicas import AsyncReplicaSet, ReplicaSet
    from gdn_client._shared_memory import AsyncSharedMemory, SharedMemory
    from gdn_client._sessions_ext import ExportedState
    from gdn_client._stream import AsyncDecodeStream, DecodeStream


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gdn_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gdn_client.{module}"), name)
    globals()[name] = value  # the next look-up is a plain global
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "AsyncClient",
    "AsyncDecodeStream",
    "AsyncReplicaSet",
    "AsyncSession",
    "AsyncSharedMemory",
    "AsyncSpeculation",
    "Client",
    "ClientOptions",
    "DeadlineExceededError",
    "DecodeStream",
    "DeviceInfo",
    "ExportedState",
    "FailedPreconditionError",
    "GdnError",
    "InvalidArgumentError",
    "ModelInfo",
    "NotFoundError",
    "ReplicaSet",
    "ResourceExhaustedError",
    "Session",
    "SharedMemory",
    "Speculation",
    "Stats",
    "UnauthenticatedError",
    "UnavailableError",
]
