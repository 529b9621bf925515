"""Which grammar library constrains decoding at the lowest cost per token on this CPU.

For each library installed (xgrammar, llguidance, outlines-core) and each grammar (a JSON
schema, any JSON object, a regex), on the served model's tokenizer: the compile time, and per
generated token the time to compute the allowed-token mask, apply it to a logits row and
advance the state. The token sequence is the same for every library: a valid document of the
grammar, tokenized, walked token by token (what a decode step does per constrained row).

    python -m bench.studies.grammar_mask [--model DIR] [--repeats 5] [--out FILE.json]

Prints one row per (library, grammar): compile ms, mask us/token (median and mean over
``--repeats`` walks, each from a fresh state timing every position once, as decoding does), apply us/token (the library's own, and the
engine's ``cpu_ops.apply_bitmask`` on the same bitmask), advance us/token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
# Strings hold most of a generated document's tokens, and a library's mask can cost far more
# inside a string than between them: the walk's document is mostly string, like real output.
DOCUMENT = json.dumps({"name": "Marie Salomea Sklodowska-Curie", "age": 66, "city": "Paris",
                       "tags": ["physics and chemistry", "radioactivity research",
                                "two Nobel prizes", "Sorbonne professor"]})
# The same document under a schema that bounds its strings (maxLength): bounded repetition is
# where lexer-based masks get expensive.
BOUNDED = {**SCHEMA, "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0},
    "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}}}
REGEX = r"[0-9]{3}-[0-9]{4} \((home|work)\)"
REGEX_TEXT = "555-0142 (work)"


@dataclass
class Row:
    library: str
    grammar: str
    compile_ms: float
    mask_us: float
    mask_mean_us: float  # the mean: a few slow positions can dominate a step
    apply_us: float  # the library's own apply (outlines-core has none: a torch index fill)
    advance_us: float
    tokens: int
    our_apply_us: float | None = None  # engine.ops.cpu_ops.apply_bitmask on the same bitmask


def _walk(make: Callable[[], object], mask: Callable, apply: Callable, advance: Callable,
          tokens: list[int], vocab: int, repeats: int) -> tuple[float, float, float, float]:
    """Per-token medians (us) of mask (and its mean) / apply / advance over ``tokens``.

    Each walk starts a fresh state and times every position's mask once, as decoding does (a
    library may cache what a position computed: timing it again there would hide the first
    time's cost); ``repeats`` walks."""
    logits = torch.zeros(1, vocab)
    m_t: list[float] = []
    a_t: list[float] = []
    s_t: list[float] = []
    for _ in range(repeats):
        state = make()
        for tok in tokens:
            t0 = time.perf_counter()
            mask(state)
            t1 = time.perf_counter()
            apply(logits, state)
            t2 = time.perf_counter()
            advance(state, tok)
            t3 = time.perf_counter()
            m_t.append(t1 - t0)
            a_t.append(t2 - t1)
            s_t.append(t3 - t2)
    med = statistics.median
    return (med(m_t) * 1e6, statistics.mean(m_t) * 1e6, med(a_t) * 1e6, med(s_t) * 1e6)


def _our_apply(make, mask, advance, tokens, bitmask, vocab: int, repeats: int) -> float:
    """Median us/token of the engine's own bitmask apply over the same walk's masks."""
    from engine.ops import cpu_ops

    state = make()
    logits = torch.zeros(1, vocab)
    times = []
    for tok in tokens:
        mask(state)
        t0 = time.perf_counter()
        cpu_ops.apply_bitmask(logits, [0], bitmask)
        times.append(time.perf_counter() - t0)
        advance(state, tok)
    return statistics.median(times) * 1e6


def bench_xgrammar(hf_tok, vocab: int, cases, repeats: int) -> list[Row]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    rows = []
    for name, kind, spec, tokens in cases:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        layout = {"any_whitespace": False, "separators": (", ", ": ")}  # as the engine's
        cg = (compiler.compile_json_schema(spec, **layout) if kind == "schema"
              else compiler.compile_json_schema('{"type": "object"}', **layout) if kind == "json"
              else compiler.compile_regex(spec))
        compile_ms = (time.perf_counter() - t0) * 1e3
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def make(cg=cg):
            return xgr.GrammarMatcher(cg)

        def mask(m, bitmask=bitmask):
            m.fill_next_token_bitmask(bitmask, 0)

        def apply(logits, m, bitmask=bitmask):
            xgr.apply_token_bitmask_inplace(logits, bitmask)

        def advance(m, tok):
            assert m.accept_token(tok), tok

        rows.append(Row("xgrammar", name, compile_ms,
                        *_walk(make, mask, apply, advance, tokens, vocab, repeats), len(tokens),
                        _our_apply(make, mask, advance, tokens, bitmask, vocab, repeats)))
    return rows


def bench_llguidance(hf_tok, vocab: int, cases, repeats: int) -> list[Row]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab)
    rows = []
    for name, kind, spec, tokens in cases:
        t0 = time.perf_counter()
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grm = (llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=layout)
               if kind == "schema"
               else llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                  defaults=layout)
               if kind == "json" else llguidance.LLMatcher.grammar_from_regex(spec))
        probe = llguidance.LLMatcher(tok, grm)
        assert not probe.is_error(), probe.get_error()
        compile_ms = (time.perf_counter() - t0) * 1e3
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

        def make(grm=grm):
            return llguidance.LLMatcher(tok, grm)

        def mask(m, bitmask=bitmask):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)

        def apply(logits, m, bitmask=bitmask):
            llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)

        def advance(m, tok):
            assert m.consume_token(tok), (tok, m.get_error())

        rows.append(Row("llguidance", name, compile_ms,
                        *_walk(make, mask, apply, advance, tokens, vocab, repeats), len(tokens),
                        _our_apply(make, mask, advance, tokens, bitmask, vocab, repeats)))
    return rows


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies spell bytes so)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def bench_outlines(hf_tok, vocab: int, cases, repeats: int) -> list[Row]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core import json_schema as oj

    eos = hf_tok.eos_token_id
    # Byte-level BPE pieces spell bytes as printable characters: the automaton needs the bytes.
    byte_of = {c: b for b, c in _gpt2_byte_chars().items()}
    by_piece: dict[bytes, list[int]] = {}
    for piece, tid in hf_tok.get_vocab().items():
        if tid != eos and tid < vocab and tid not in hf_tok.all_special_ids:
            raw = bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) \
                else piece.encode()
            by_piece.setdefault(raw, []).append(tid)
    vocabulary = Vocabulary(eos, by_piece)
    rows = []
    for name, kind, spec, tokens in cases:
        regex = (oj.build_regex_from_schema(spec) if kind == "schema"
                 else oj.build_regex_from_schema(json.dumps({"type": "object"}))
                 if kind == "json" else spec)
        t0 = time.perf_counter()
        index = Index(regex, vocabulary)
        compile_ms = (time.perf_counter() - t0) * 1e3

        def make(index=index):
            return Guide(index)

        def mask(g):
            g.get_tokens()

        def apply(logits, g):
            allowed = torch.tensor(g.get_tokens())
            keep = torch.full_like(logits, float("-inf"))
            keep[0, allowed] = 0
            logits.add_(keep)

        def advance(g, tok):
            g.advance(tok)

        rows.append(Row("outlines-core", name, compile_ms,
                        *_walk(make, mask, apply, advance, tokens, vocab, repeats), len(tokens)))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the served model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from engine.text.tokenizer import load_tokenizer
    from engine.weights.resolve import resolve_model

    model = resolve_model(args.model)
    tok = load_tokenizer(model.model_dir)
    hf_tok = tok.hf_tokenizer
    with open(f"{model.model_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    cases = [("json_schema", "schema", json.dumps(SCHEMA), tok.encode(DOCUMENT)),
             ("json_bounded", "schema", json.dumps(BOUNDED), tok.encode(DOCUMENT)),
             ("json_object", "json", None, tok.encode(DOCUMENT)),
             ("regex", "regex", REGEX, tok.encode(REGEX_TEXT))]
    rows: list[Row] = []
    for bench in (bench_xgrammar, bench_llguidance, bench_outlines):
        try:
            rows += bench(hf_tok, vocab, cases, args.repeats)
        except ImportError as e:
            print(f"{bench.__name__[6:]}: not installed ({e})")
    print(f"{'library':<14} {'grammar':<12} {'compile ms':>10} {'mask p50':>8} {'mask mean':>9} "
          f"{'apply us':>9} {'ours us':>8} {'advance us':>10} {'tokens':>6}")
    for r in rows:
        ours = "-" if r.our_apply_us is None else f"{r.our_apply_us:.1f}"
        print(f"{r.library:<14} {r.grammar:<12} {r.compile_ms:>10.1f} {r.mask_us:>8.1f} "
              f"{r.mask_mean_us:>9.1f} {r.apply_us:>9.1f} {ours:>8} {r.advance_us:>10.1f} "
              f"{r.tokens:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": vocab, "model": model.model_id,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
