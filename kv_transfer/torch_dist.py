"""Cross-process KV transport over pairwise torch.distributed groups (gloo on CPU, NCCL on GPU).

The decode worker (``TorchDistReceiver``, ``kv_transfer.receiver``) hosts a TCPStore; each
prefill worker (``TorchDistSender``, ``kv_transfer.sender``) connects to it as a client. Every
(prefill, decode) pair gets its own 2-rank group (rank 0 = decode, rank 1 = prefill) over
``PrefixStore(f"pair/{prefill_id}/{decode_id}/{generation}")``: no global world, no
``init_process_group``. Groups are built lazily, cached per peer, and discarded (the next
transfer uses generation + 1) when a transfer fails, stalls or the peer dies.

Store keys (all in the decode worker's store, per prefill id ``p``):
  ``kv/{p}/gen``            counter; the sender bumps it to propose a new generation g
  ``kv/{p}/{g}/layout``     the sender's KVLayout (JSON)
  ``kv/{p}/{g}/verdict``    the receiver's "ok" or the handshake refusal message
  ``kv/{p}/{g}/retired``    set by whichever side discards generation g

On the pair, messages are ordered and tag-free (``kv_transfer.wire``): a header naming
(transfer, layer) before each layer, one sending thread and one reading thread per pair. NCCL
ignores tags and matches messages in posting order, so this is the only shape it can carry
safely with several requests' layers interleaved; gloo runs the very same protocol, so every
CPU test exercises the GPU path's ordering.

Facts about gloo this design follows (measured on torch 2.13): ``Work.is_completed()`` never
turns true for send/recv and ``get_future()`` is unsupported, so completion is observed by a
thread blocked in ``Work.wait``; a wait that times out closes the whole pair, and neither
``abort()`` nor ``shutdown()`` wakes a blocked wait. Hence waits on data never time out and
run on background threads, deadlines are enforced in Python, and a group is torn down
deliberately by timing out a receive on the reserved ``KILL_TAG`` (which closes the
connection and wakes every blocked wait on both sides). NCCL: see ``kv_transfer.pairs``.
"""

from kv_transfer.receiver import TorchDistReceiver
from kv_transfer.sender import TorchDistSender

__all__ = ["TorchDistReceiver", "TorchDistSender"]
