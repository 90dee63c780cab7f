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

`AsyncClient` is the asyncio twin; `Client.stream()` pipelines steps over one DecodeStream.
All failures raise `GdnError` (``.code`` is the grpc.StatusCode).
"""
from gdn_client._aio import AsyncClient, AsyncSession
from gdn_client._client import Client, Session, Speculation
from gdn_client._replicas import ReplicaSet
from gdn_client._sessions_ext import ExportedState
from gdn_client._codec import DeviceInfo, ModelInfo, Stats
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
from gdn_client._stream import AsyncDecodeStream, DecodeStream

__all__ = [
    "AsyncClient",
    "AsyncDecodeStream",
    "AsyncSession",
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
    "Speculation",
    "Stats",
    "UnauthenticatedError",
    "UnavailableError",
]
