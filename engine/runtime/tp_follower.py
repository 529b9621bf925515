"""A follower rank of a tensor-parallel engine (``python -m engine.runtime.tp_follower <spec>``,
started by ``engine.parallel.ranks.TPRanks``).

It joins the group, loads only its slices of the weights, waits for rank 0's ``init``
(context length and KV pool size, so every rank's cache is alike), then runs each step rank 0
broadcasts (``ModelRunner.follow_step``) until it is ended, with rank 0's control messages
(imported KV, held pages, LoRA adapters loaded and dropped, its worker's rank agent:
``engine.parallel.agents``) between steps. It exits by itself when rank 0's
process is gone (its parent pid changes) or when a collective fails; rank 0's next collective
then fails too, and the engine is dead as a whole: a worker whose rank dies is a dead worker.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from engine.config import CacheConfig, kv_attention_backend
from engine.executor.device import plan_device
from engine.executor.model_runner import ModelRunner
from engine.lora.registry import LoRARegistry
from engine.models.llama import LlamaForCausalLM
from engine.parallel.agents import FollowerContext, RankAgent, load_agent
from engine.parallel.comm import TPComm
from engine.parallel.ranks import FollowerSpec, rank_device, rank_threads
from engine.parallel.sharding import TPShard
from engine.runtime.build import lora_torch_dtype
from engine.runtime.llm_engine import EngineArgs
from engine.tuning.runner_plans import tune_runner
from engine.weights.huge_pages import move_weights_to_huge_pages
from engine.weights.loader import load_state_dict
from engine.weights.resolve import load_model_config, resolve_model

log = logging.getLogger(__name__)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)  # rank 0 is gone: nobody will send another step
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def serve(spec: FollowerSpec) -> None:
    """Join, load, then run rank 0's steps until ended (returns only by raising)."""
    args = EngineArgs(**spec.args)
    torch.set_num_threads(rank_threads(args.num_threads, spec.size))
    plan = plan_device(rank_device(args.device, spec.rank), args.dtype, kv_attention_backend(args),
                       args.cuda_graphs)
    shard = TPShard(spec.rank, spec.size)
    comm = TPComm(shard, spec.address, plan.device)
    resolved = resolve_model(args.model, cache_dir=args.cache_dir)
    cfg = load_model_config(resolved.model_dir, dtype=plan.dtype, model_id=resolved.model_id)
    weights = load_state_dict(resolved.model_dir, getattr(torch, cfg.dtype),
                              lambda n: shard.slice_of(n, cfg))
    kind, max_len, num_blocks = comm.broadcast()
    if kind != "init":
        raise RuntimeError(f"expected rank 0's init, got {kind!r}")
    model = LlamaForCausalLM(cfg, max_len, comm)
    model.load_hf_state_dict(weights)
    del weights
    if args.quantization in ("int8", "int4"):  # each rank quantizes its own shard
        model.quantize(args.quantization)
    model = model.to(plan.device)
    model.place_quantized(plan.device)
    move_weights_to_huge_pages(model)
    # Only the block size matters here: the pool's size came from rank 0 (num_blocks).
    cache = CacheConfig(block_size=args.block_size,
                        enable_prefix_caching=args.enable_prefix_caching,
                        kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(model, cache, num_blocks, attention_backend=plan.attention_backend,
                         cuda_graphs=False, max_num_seqs=args.max_num_seqs,
                         max_model_len=max_len)
    tune_runner(args, plan, model, runner)
    if args.enable_lora:  # rank 0 sends every adapter it holds (engine.lora.registry)
        runner.lora = LoRARegistry(cfg, args.max_loras, args.max_lora_rank, args.max_cpu_loras,
                                   lora_torch_dtype(args, plan.dtype), shard=shard)
    ctx = FollowerContext(comm, runner.rank_kv)
    agent = None
    while True:
        ctl, main = comm.broadcast()
        for msg in ctl:
            agent = _control(runner, agent, msg, ctx)
        if main is None:
            continue
        if main[0] == "step":
            runner.follow_step(main[1], agent.on_export if agent is not None else None)
        elif main[0] == "prompt_logits":
            runner.follow_prompt_logits(*main[1:])
        else:
            raise RuntimeError(f"unknown tensor-parallel message {main[0]!r}")


def _control(runner: ModelRunner, agent: RankAgent | None, msg: tuple,
             ctx: FollowerContext) -> RankAgent | None:
    """Apply one of rank 0's control messages; returns the rank's agent (built by "agent")."""
    kind = msg[0]
    if kind == "kv_writes":
        runner.rank_kv.follow_kv_writes(msg[1])
    elif kind == "reserve":
        runner.rank_kv.hold_pages(*msg[1:])
    elif kind == "unreserve":
        runner.rank_kv.drop_pages(msg[1])
        if agent is not None:
            agent.on_unreserve(msg[1])
    elif kind == "agent":
        if agent is not None:
            agent.close()
        agent = load_agent(msg[1])(ctx, msg[2])
        ctx.reply("ready", agent.ready())
    elif kind in ("lora_load", "lora_drop"):
        runner.lora.follow(msg)
    elif kind == "tell":
        if agent is None:
            raise RuntimeError("a rank-agent message came before any agent was started")
        agent.on_tell(msg[1])
    else:
        raise RuntimeError(f"unknown tensor-parallel control message {kind!r}")
    return agent


def main(argv: list[str]) -> int:
    spec = FollowerSpec.from_json(argv[1])
    _exit_with_parent(spec.parent_pid)
    logging.basicConfig(level=logging.WARNING,
                        format=f"tp-rank-{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        serve(spec)
    except Exception:
        # Rank 0's next collective fails too: the engine stops as a whole.
        log.exception("tensor-parallel rank %d failed", spec.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
