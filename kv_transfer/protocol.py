"""KV-transfer protocol: layouts, transfer specs, the handshake check and the wire shape.

Pure dataclasses and functions (no I/O). The transport (``kv_transfer.sender`` /
``kv_transfer.receiver``, wire format in ``kv_transfer.wire``) and the workers share these
definitions, so a prefill and a decode worker agree on what one transfer is: one message per
layer, a tensor ``[2, num_tokens, num_kv_heads, head_dim]`` (K then V, token-contiguous) in
the layout's dtype, announced by a header naming ``(transfer_id, layer)``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from engine.config import DTYPE_BYTES, KV_CACHE_DTYPE_CHOICES, kv_row_bytes

# torch is imported where tensors are touched: a router's front door, which reads layouts and
# addresses only, loads without it.
if TYPE_CHECKING:
    import torch

# Reserved tag, used only to tear a pair's gloo connection down on purpose (data uses tag 0).
KILL_TAG = 2**31 - 1


class KVHandshakeError(ValueError):
    """The two sides' KV layouts differ; the message names the first mismatched field."""


class KVTransferError(RuntimeError):
    """A transfer failed (peer died, group torn down, callback raised, ...)."""


class KVTransferTimeout(KVTransferError):
    """A transfer (or the group set-up it needed) did not complete within its timeout."""


class KVPeerUnreachableError(KVTransferError):
    """The peer's advertised KV address cannot be reached (wrong address, link down, firewall).
    The message names the address; the router routes around that peer for a while."""


class KVTransferAborted(KVTransferError):
    """The transfer was aborted by a local ``abort()`` call."""


@dataclass(frozen=True)
class PeerAddress:
    """Where a decode worker's KV endpoint listens (for torch_dist: its TCPStore)."""

    worker_id: str
    host: str
    port: int


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on before any KV byte moves. ``kv_cache_dtype``: how the
    pools store KV (``engine.config.KV_CACHE_DTYPE_CHOICES``): ``"auto"`` moves values of
    ``dtype``; ``"int8"`` moves the pools' int8 rows as stored, each token's K (V) of each KV
    head as ``head_dim`` int8 values and their fp32 scale (``row_width`` bytes), so a layer
    message is ``[2, T, H, head_dim + 4]`` int8: pages and scales, nothing converted."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} unsupported; "
                             f"supported: {', '.join(DTYPE_BYTES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"KVLayout.kv_cache_dtype {self.kv_cache_dtype!r} unsupported; "
                             f"supported: {', '.join(KV_CACHE_DTYPE_CHOICES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_model_config(cls, cfg: Any, kv_cache_dtype: str = "auto") -> KVLayout:
        """Build from anything with model_id, dtype, num_layers, num_kv_heads, head_dim, and
        the pools' ``kv_cache_dtype``."""
        return cls(cfg.model_id, cfg.dtype, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                   kv_cache_dtype)

    @property
    def wire_dtype(self) -> str:
        """The dtype of a layer message's elements: ``dtype``, or ``"int8"`` (int8 rows)."""
        return self.dtype if self.kv_cache_dtype == "auto" else "int8"

    @property
    def row_width(self) -> int:
        """Elements of a layer message's last dimension: ``head_dim`` (+ 4 for int8 rows)."""
        return (self.head_dim if self.kv_cache_dtype == "auto"
                else kv_row_bytes(self.head_dim, self.dtype, self.kv_cache_dtype))

    @property
    def element_bytes(self) -> int:
        return 1 if self.kv_cache_dtype != "auto" else DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one prompt token's KV costs on the wire (every layer, K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self.element_bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.wire_dtype)

    def check_compatible(self, other: KVLayout, self_role: str = "decode",
                         other_role: str = "prefill") -> None:
        """Raise KVHandshakeError naming the first field that differs (with both values)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise KVHandshakeError(
                    f"KV handshake refused: {f.name} differs "
                    f"({other_role}={theirs!r}, {self_role}={mine!r})"
                )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class KVTransferSpec:
    """One request's prompt-KV transfer. The router assigns the request id; the receiving
    decode worker assigns the transfer id (named in every layer's header), because it alone
    sees every transfer into it when several routers reserve at once, and ``start_token``: the prompt
    positions before it are already in its own prefix cache, so the transfer carries
    positions ``[start_token, start_token + num_tokens)`` only (the prefill worker neither
    reads nor sends the rest)."""

    request_id: str
    transfer_id: int
    num_tokens: int  # tokens carried, not the prompt's length
    layout: KVLayout
    start_token: int = 0
    # The model's KV heads [lo, hi) this transfer carries: None, every one. Under tensor
    # parallelism a transfer is split into routes, one per (prefill rank, decode rank) pair
    # (``kv_transfer.routes``), each carrying the heads the two ranks share.
    heads: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("KVTransferSpec.request_id must be non-empty")
        if self.transfer_id < 0:
            raise ValueError(f"KVTransferSpec.transfer_id must be >= 0, got {self.transfer_id}")
        if self.num_tokens <= 0:
            raise ValueError(f"KVTransferSpec.num_tokens must be > 0, got {self.num_tokens}")
        if self.start_token < 0:
            raise ValueError(f"KVTransferSpec.start_token must be >= 0, got {self.start_token}")
        if self.heads is not None and not 0 <= self.heads[0] < self.heads[1] <= \
                self.layout.num_kv_heads:
            raise ValueError(f"KVTransferSpec.heads {self.heads} is not a range of the "
                             f"model's {self.layout.num_kv_heads} KV heads")

    @property
    def num_heads(self) -> int:
        """KV heads carried (the layout's, unless ``heads`` names a part)."""
        return self.layout.num_kv_heads if self.heads is None else self.heads[1] - self.heads[0]

    @property
    def prompt_len(self) -> int:
        """The whole prompt's length: the skipped prefix plus the tokens carried."""
        return self.start_token + self.num_tokens

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Wire shape of one layer message: [2, num_tokens, num_heads, head_dim] (int8 rows:
        head_dim + 4, ``KVLayout.row_width``)."""
        return (2, self.num_tokens, self.num_heads, self.layout.row_width)

    @property
    def layer_nbytes(self) -> int:
        n = 1
        for d in self.layer_shape:
            n *= d
        return n * self.layout.element_bytes


def check_layer_tensor(spec: KVTransferSpec, layer: int, kv: torch.Tensor) -> None:
    """ValueError unless kv is a contiguous [2, T, H, D] tensor of the spec's dtype and layer is valid."""
    if not 0 <= layer < spec.layout.num_layers:
        raise ValueError(f"layer {layer} out of range for {spec.layout.num_layers} layers")
    if tuple(kv.shape) != spec.layer_shape:
        raise ValueError(f"kv shape {tuple(kv.shape)} != expected {spec.layer_shape} (2, T, H, D)")
    if kv.dtype != spec.layout.torch_dtype:
        raise ValueError(f"kv dtype {kv.dtype} != layout dtype {spec.layout.wire_dtype}")
    if not kv.is_contiguous():
        raise ValueError("kv must be contiguous (one message per layer, no strided views)")
