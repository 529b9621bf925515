"""The ordered, tag-free wire format of one (prefill, decode) pair's KV channel.

NCCL matches point-to-point messages in posting order and ignores tags, so the transport
must never rely on tags to tell transfers apart. Instead every layer message is preceded by a
fixed-size ``Header`` naming its transfer and layer, and both sides keep one order per pair:
the sender posts (header, payload) pairs from a single thread per peer, the receiver reads a
header, then the payload it announces, from a single thread per peer. Several requests'
layers may interleave freely on the channel (a batched prefill step completes several
prompts and streams their layers in turn); the header keeps each one apart.

Both backends run exactly this protocol (gloo on CPU, NCCL on GPU), all on tag ``DATA_TAG``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.protocol import KVTransferError

# "KV" and the wire version in one word: a receiver reading anything else is out of step
# with its sender (or talks to an older one) and tears the pair down instead of guessing.
HEADER_MAGIC = 0x4B56_0002
HEADER_LEN = 4  # int64 words: magic, transfer id, layer, payload rows
DATA_TAG = 0
# A header with this layer and no payload: the sender gave up on the transfer (the receiver
# fails it at once instead of holding its pages until the lease runs out).
ABORT_LAYER = -1


class KVProtocolError(KVTransferError):
    """The channel is out of step (bad magic, a layer out of order): the pair is discarded."""


@dataclass(frozen=True)
class Header:
    """Announces one message: layer ``layer`` of transfer ``transfer_id``, whose payload is
    ``[2, num_tokens, num_kv_heads, head_dim]`` in the pair's layout (no payload when
    ``num_tokens == 0``, as for ``ABORT_LAYER``)."""

    transfer_id: int
    layer: int
    num_tokens: int

    @property
    def has_payload(self) -> bool:
        return self.num_tokens > 0

    def encode(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The header as an int64 ``[HEADER_LEN]`` tensor on ``device`` (NCCL: the GPU)."""
        return torch.tensor([HEADER_MAGIC, self.transfer_id, self.layer, self.num_tokens],
                            dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, t: torch.Tensor) -> Header:
        """Parse a received header; KVProtocolError when it is not one of ours."""
        magic, transfer_id, layer, num_tokens = t.tolist()  # one sync on a GPU tensor
        if magic != HEADER_MAGIC:
            raise KVProtocolError(f"KV channel out of step: header magic {magic:#x}, "
                                  f"expected {HEADER_MAGIC:#x}")
        if num_tokens < 0 or (layer == ABORT_LAYER) != (num_tokens == 0) or layer < ABORT_LAYER:
            raise KVProtocolError(f"malformed KV header: transfer {transfer_id}, layer {layer}, "
                                  f"{num_tokens} tokens")
        return cls(transfer_id, layer, num_tokens)


def empty_header(device: torch.device | str = "cpu") -> torch.Tensor:
    """A receive buffer for one header."""
    return torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
