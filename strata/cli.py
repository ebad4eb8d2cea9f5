"""strata: command-line entry point.

  strata generate  [--model DIR] (--prompt TEXT | --tokens IDS) --max-tokens N ...
  strata score     [--model DIR] --tokens IDS --mode prefill|decode|chunk:N [--start K] --save F.npz
  strata inspect   DIR
  strata pack      SRC DST [--buffer-mb 32] | strata pack --verify DST
  strata plan      DIR --devices cuda:0,cuda:1 --budget 96GB [--context N] [--reserve 4GiB]
  strata make-tiny OUT [--preset tiny|real-vocab] [--seed N]
  strata serve     [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...

With no --model, the embedded tiny real-vocabulary fixture is generated into the cache
directory ($STRATA_CACHE or ~/.cache/strata) on first use.

generate, bench decode and serve take --parallel layer|tp --devices D0,D1[,...] [--split
0-17,18-39]: one process per device, rank 0 runs the command (runtime/parallel.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import strata  # noqa: F401  (sets the CPU kernel capability before torch loads)

import torch

from strata.engram_store import IO_THREADS
from strata.argtypes import COUNT, NONNEGATIVE, PORT, SEED, THREADS, count_or_auto, integer
from strata.errors import StrataError


def _model_dir(arg: str | None) -> Path:
    from strata.checkpoint.tiny import default_model_dir
    return Path(arg) if arg else default_model_dir()


def _load(args) -> "Model":  # noqa: F821
    if getattr(args, "parallel", None):
        return _load_parallel(args)
    for flag in ("devices", "split"):
        if getattr(args, flag, None):
            raise StrataError(f"--{flag} is for a multi-device run: add --parallel layer|tp "
                              "(one device: --device)")
    from strata.model.model import Model
    from strata.model.numerics import Numerics
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise StrataError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise StrataError(f"--device {args.device}: CUDA is not available on this machine")
        if (device.index or 0) >= n:
            raise StrataError(f"--device {args.device}: this machine has {n} CUDA device(s)")
    elif device.type != "cpu":
        raise StrataError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    mode = args.numerics or ("vendor" if device.type == "cuda" else "reference")
    nx = Numerics.for_device(device, mode, args.dtype, args.vendor_stale_index_k)
    from strata.checkpoint.loader import TensorLoader
    # Progress bar (bytes, GB/s) on stderr when it is a terminal, unless --quiet.
    loader = TensorLoader(device, buffer_bytes=args.load_buffer_mb << 20,
                          progress=False if args.quiet else None)
    _check_engram_args(args)
    if args.draft_cache_mb is not None and args.draft_cache_mb < 1:
        raise StrataError(f"--draft-cache-mb {args.draft_cache_mb}: must be ≥ 1")
    return Model.load(_model_dir(args.model), device, nx, loader=loader, engram=args.engram,
                      engram_cache_bytes=args.engram_cache_mb << 20,
                      engram_options={"io_threads": args.engram_io_threads},
                      draft_experts=args.draft_experts,
                      draft_cache_bytes=None if args.draft_cache_mb is None
                      else args.draft_cache_mb << 20)


def _check_engram_args(args) -> None:
    if args.engram_cache_mb < 1:
        raise StrataError(f"--engram-cache-mb {args.engram_cache_mb}: must be ≥ 1")
    if args.engram_io_threads < 1:
        raise StrataError(f"--engram-io-threads {args.engram_io_threads}: must be ≥ 1")


def _load_parallel(args):
    """--parallel layer|tp: one process per --devices entry (started here, or joined from
    torch.distributed's environment); returns rank 0's ParallelModel. On any other rank of an
    environment-launched group this serves rank 0 until it shuts down, then exits."""
    from strata.config import ModelConfig
    from strata.runtime.parallel import ParallelSpec, launch, parse_devices, parse_split
    from strata.serve.server import DEFAULT_CAPACITY
    if not args.devices:
        raise StrataError(f"--parallel {args.parallel} needs --devices, one per rank "
                          "(e.g. cuda:0,cuda:1 or cpu,cpu)")
    devices = parse_devices(args.devices)
    model_dir = _model_dir(args.model)
    split = None
    if args.split:
        if args.parallel != "layer":
            raise StrataError("--split is for --parallel layer")
        split = parse_split(args.split, ModelConfig.from_model_dir(model_dir).n_layers,
                            len(devices))
    _check_engram_args(args)
    options = {"engram": args.engram, "engram_cache_bytes": args.engram_cache_mb << 20,
               "engram_options": {"io_threads": args.engram_io_threads}}
    if getattr(args, "draft_experts", "device") != "device":
        options["draft_experts"] = args.draft_experts
        if args.draft_cache_mb is not None:
            options["draft_cache_bytes"] = args.draft_cache_mb << 20
    spec = ParallelSpec(args.parallel, devices, str(model_dir), numerics=args.numerics,
                        act_dtype=args.dtype, vendor_stale_index_k=args.vendor_stale_index_k,
                        split=split, tp_attention=args.tp_attention,
                        peer_timeout=args.peer_timeout,
                        context=args.capacity or DEFAULT_CAPACITY,
                        buffer_bytes=args.load_buffer_mb << 20,
                        progress=False if args.quiet else None, load_options=options)
    return launch(spec)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", choices=["layer", "tp"],
                   help="run over several devices, one process each (torch.distributed: NCCL "
                        "on GPUs, gloo on CPU): layer = contiguous layer ranges per device; "
                        "tp = attention heads and experts split across devices. Tokens are "
                        "identical to one device. Without RANK/WORLD_SIZE/MASTER_ADDR/"
                        "MASTER_PORT in the environment the ranks are started here; with them "
                        "(torchrun, or the same command on each host) this process is RANK")
    p.add_argument("--devices", help="with --parallel: one device per rank, in rank order "
                                     "(cuda:0,cuda:1; cpu,cpu; 'cuda' = cuda:LOCAL_RANK)")
    p.add_argument("--split", help="with --parallel layer: layer ranges per device, e.g. "
                                   "0-17,18-39 (default: the placement planner's balanced split)")
    p.add_argument("--tp-attention", choices=["heads", "replicated"], default="heads",
                   help="with --parallel tp: split attention by heads (2 collectives per layer) "
                        "or compute it on every device (1 collective per layer)")
    p.add_argument("--peer-timeout", type=float, default=15.0,
                   help="with --parallel: seconds without a heartbeat before a rank counts as "
                        "gone and the others stop with an error (default 15; a killed process "
                        "on a live host is noticed at once)")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise StrataError(f"--tokens {text!r}: expected integers separated by commas or spaces") \
            from None
    if not ids:
        raise StrataError("--tokens: no token ids given")
    return ids


def _check_ids(ids: list[int], cfg) -> None:
    """--tokens against the model's vocabulary (known once it is loaded)."""
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise StrataError(f"--tokens: {bad[0]} is not a token id of this model "
                          f"(0..{cfg.vocab_size - 1})")


def _check_writable(path: str, flag: str) -> None:
    """An output file's folder exists and takes files — checked before the work, whose
    result would otherwise be lost at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise StrataError(f"{flag} {path}: is a folder; name a file")
    if not os.path.isdir(folder):
        raise StrataError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise StrataError(f"{flag} {path}: the folder {folder} is not writable")


def _check_capacity(args, cfg) -> None:
    if args.capacity is not None and args.capacity > cfg.max_position_embeddings:
        raise StrataError(f"--capacity {args.capacity}: this model's context is at most "
                          f"{cfg.max_position_embeddings} tokens")


def _add_graphs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode steps, DSpark verify windows and drafts from CUDA graphs "
                        "(default on; the same tokens, several times faster than eager "
                        "launches on CUDA; a no-op on CPU)")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", action="store_true", help="decode with DSpark")
    p.add_argument("--draft-length", type=COUNT, default=None,
                   help="with --speculative: verify this many drafts a window (default: "
                        "adaptive, from the draft's confidences and window prices measured "
                        "at start-up)")


def _add_prefill_chunk_arg(p: argparse.ArgumentParser, flag: str = "--prefill-chunk",
                           auto: bool = False) -> None:
    """auto: the flag also takes "auto", its default — the largest chunk the devices' memory
    leaves room for, measured at start (runtime.chunk_size; for commands that prefill many
    prompts: one prompt gains less from the bigger chunk than the measurement costs)."""
    from strata.runtime.chunk_size import LARGEST_AUTO_CHUNK
    from strata.runtime.session import PREFILL_CHUNK
    what = "prompt rows a prefill forward takes at once; smaller needs less scratch memory " \
           "and prefills slower"
    if auto:
        p.add_argument(flag, type=count_or_auto, default="auto", dest="prefill_chunk",
                       help=f"{what} (default auto: on CUDA, the largest of {PREFILL_CHUNK}.."
                            f"{LARGEST_AUTO_CHUNK} whose scratch, measured at start, fits; "
                            f"elsewhere {PREFILL_CHUNK})")
    else:
        p.add_argument(flag, type=COUNT, default=PREFILL_CHUNK, dest="prefill_chunk",
                       help=f"{what} (default {PREFILL_CHUNK})")


def _check_speculative_args(args) -> None:
    if args.draft_length is not None and not args.speculative:
        raise StrataError("--draft-length needs --speculative")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder (default: the embedded tiny fixture)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N (default auto: cuda when there is one, else cpu)")
    p.add_argument("--numerics", choices=["reference", "vendor"],
                   help="reference: fp32, no quantisation points; vendor: every quantisation "
                        "point of the official path (default: reference on CPU, vendor on CUDA)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="activation dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--vendor-stale-index-k", action="store_true",
                   help="reproduce the vendor's stale index-key quirk (spec §2.6)")
    p.add_argument("--capacity", type=integer(2), default=None,
                   help="context capacity in tokens (default: prompt + max tokens)")
    p.add_argument("--load-buffer-mb", type=COUNT, default=256,
                   help="size of each of the 4 host staging buffers weights stream through "
                        "while loading (default 256: 1 GiB in all)")
    p.add_argument("--quiet", action="store_true", help="no loading progress bar")
    p.add_argument("--engram", choices=["device", "disk"], default="device",
                   help="device: load the Engram tables into device memory; disk: leave them on "
                        "disk, read per token behind an LRU row cache with prefetch (the ~203 GB "
                        "tables of V4.1 need this)")
    p.add_argument("--draft-experts", choices=["device", "cache"], default="device",
                   help="cache: keep the DSpark stages' routed experts off the device and bring "
                        "each draft step's experts in through a bounded cache (for when they do "
                        "not fit beside the backbone; drafts are identical)")
    p.add_argument("--draft-cache-mb", type=COUNT, default=None,
                   help="with --draft-experts cache: its device budget (default 1024, or more "
                        "when the device has free memory)")
    p.add_argument("--engram-cache-mb", type=NONNEGATIVE, default=1024,
                   help="with --engram disk: host RAM for cached Engram rows, all tables "
                        "together (default 1024)")
    p.add_argument("--engram-io-threads", type=THREADS, default=IO_THREADS,
                   help="with --engram disk: threads reading each table's rows (the queue "
                        f"depth the disk sees; default {IO_THREADS})")


def cmd_generate(args) -> int:
    from strata.runtime.sampling import SamplingParams
    from strata.runtime.session import Session
    from strata.runtime.speculative import speculative_config
    from strata.tokenizer import load_tokenizer, tokenizer_path
    _check_speculative_args(args)
    prompt = _parse_ids(args.tokens) if args.tokens is not None else None
    model = _load(args)
    _check_capacity(args, model.cfg)
    model_dir = _model_dir(args.model)
    tok = load_tokenizer(model_dir)
    if prompt is not None:
        _check_ids(prompt, model.cfg)
    else:
        import deepseek_recipe as dr
        conv = dr.Conversation([dr.UserMessage(args.prompt)], thinking_mode=args.thinking)
        rtok = dr.Tokenizer.from_file(str(tokenizer_path(model_dir)))
        prompt = list(dr.DeepseekV41Encoding().with_tokenizer(rtok).encode(conv))
    params = SamplingParams(args.temperature, args.top_p, args.seed)
    cap = args.capacity or len(prompt) + args.max_tokens
    # One prompt, the state not reused afterwards: the exact decoder-skipping prefill applies
    # (on one device and over a group alike: tests/test_parallel.py).
    spec, costs = speculative_config(model, args.draft_length, args.graphs) \
        if args.speculative else (None, None)
    session = Session(model, cap, args.prefill_chunk, decoder_skip=True,
                      speculative=spec, costs=costs, graphs=args.graphs)
    t0 = time.perf_counter()
    result = session.run(prompt, args.max_tokens, params)
    dt = time.perf_counter() - t0
    spec_stats = session.stats.as_dict() if session.stats is not None else None
    if args.json:
        print(json.dumps({"prompt_tokens": prompt, "tokens": result.tokens,
                          "text": tok.decode(result.tokens, skip_special_tokens=False),
                          "finish_reason": result.finish_reason, "seconds": dt,
                          "speculative": spec_stats}))
    else:
        print(tok.decode(result.tokens, skip_special_tokens=False))
        dspark = "" if spec_stats is None else (
            f", DSpark {spec_stats['windows']} windows, "
            f"{spec_stats['mean_committed_per_window']:.2f} tokens each")
        print(f"[{len(prompt)} prompt tokens, {len(result.tokens)} generated, "
              f"{result.finish_reason}, {dt:.2f} s{dspark}]", file=sys.stderr)
    return 0


def cmd_score(args) -> int:
    import numpy as np
    ids = _parse_ids(args.tokens)
    save = args.save if args.save.endswith(".npz") else args.save + ".npz"  # (numpy's name)
    _check_writable(save, "--save")
    model = _load(args)
    _check_capacity(args, model.cfg)
    _check_ids(ids, model.cfg)
    if not 0 <= args.start < len(ids):
        raise StrataError(f"--start {args.start}: must be in 0..{len(ids) - 1}")
    mode = args.mode
    if mode == "prefill":
        chunk = len(ids)
    elif mode == "decode":
        chunk = 1
    elif mode.startswith("chunk:") and mode[6:].isdigit() and int(mode[6:]) > 0:
        chunk = int(mode[6:])
    else:
        raise StrataError(f"--mode {mode!r}: expected prefill, decode or chunk:N")
    state = model.new_state(args.capacity or len(ids))
    tokens = torch.tensor(ids)
    out = []
    for lo, hi in ((0, args.start), (args.start, len(ids))):
        for i in range(lo, hi, chunk):
            j = min(i + chunk, hi)
            logits, _ = model.forward(tokens[i:j], state, logits="all" if lo == args.start else "none")
            if logits is not None:
                out.append(logits.cpu())
    logits = torch.cat(out).numpy()
    np.savez(save, logits=logits, tokens=np.array(ids),
             positions=np.arange(args.start, len(ids)), mode=mode)
    print(f"saved logits {list(logits.shape)} for positions {args.start}..{len(ids) - 1} "
          f"to {save}")
    return 0


def _group(name: str) -> str:
    if name.startswith("mtp."):
        return "dspark"
    if name.startswith(("vision.", "aligner.")):
        return "vision"
    if ".engram.embed." in name:
        return "engram tables"
    if ".engram." in name:
        return "engram projections"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".ffn.shared_experts." in name:
        return "shared experts"
    if ".ffn.gate" in name:
        return "router"
    if ".attn.compressor." in name:
        return "compressor"
    if ".attn.indexer." in name:
        return "indexer"
    if ".attn." in name:
        return "attention"
    if ".hc_" in name:
        return "mhc"
    if name.endswith("norm.weight"):
        return "norms"
    if name.split(".")[0] in ("embed", "head", "norm", "image_start", "image_end", "image_newline"):
        return "embed/head"
    return "other"


def cmd_inspect(args) -> int:
    from strata.checkpoint.pack import (PackFolder, check_loadable, checkpoint_format, is_pack,
                                        pack_bytes, verify_files)
    from strata.checkpoint.safetensors_io import CheckpointFolder
    from strata.config import ModelConfig
    folder = Path(args.dir)
    cfg = ModelConfig.from_model_dir(folder)
    packed = is_pack(folder)
    # A pack is described even when its files are bad; the check's outcome is printed below.
    ckpt = PackFolder(folder, verify="none") if packed else CheckpointFolder(folder)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    dtypes: dict[str, int] = defaultdict(int)
    for name in ckpt.names():
        info = ckpt.info(name)
        g = groups[_group(name)]
        g[0] += 1
        g[1] += info.nbytes
        dtypes[info.dtype] += info.nbytes
    fmt = checkpoint_format(ckpt)
    head = "strata " + fmt if packed else ("EXL3" if fmt.startswith("EXL3") else fmt)
    print(f"{folder}: {head}; {len(ckpt.files())} file(s), {len(ckpt.names())} tensors, "
          f"{ckpt.total_bytes() / 1e9:.3f} GB")
    if packed:
        m = ckpt.manifest
        files = m["files"]
        n_stacked = sum(len(r.get("stacked", {})) for r in files)
        tables = [r for r in files if r["kind"] == "engram"]
        print(f"  format: strata pack v{m['version']} of {ckpt.source_format} (packed from "
              f"{ckpt.source_path}); {n_stacked} stacked expert tensors; "
              f"{len(tables)} Engram record file(s)"
              + (f" of {tables[0]['record_bytes']}-byte records" if tables else ""))
        try:
            hashed = verify_files(folder, m, "size")
            note = f" ({len(hashed)} changed since packing: checksums match)" if hashed else ""
            print(f"  manifest: every file present with its recorded size{note}; full check: "
                  f"strata pack --verify {folder}")
        except StrataError as e:
            print(f"  manifest: MISMATCH: {e}")
        print(f"  on disk: {sum(r['bytes'] for r in files) / 1e9:.3f} GB in {len(files)} "
              "files (already packed)")
    else:
        print(f"  format: {fmt}")
    print(f"  layers {cfg.n_layers}, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}"
          f"×{cfg.head_dim}, vocab {cfg.vocab_size}, experts {cfg.n_routed_experts} top-"
          f"{cfg.num_experts_per_tok}, window {cfg.sliding_window}")
    print(f"  compress ratios {list(cfg.compress_ratios[:cfg.n_layers])}; kv sources "
          f"{list(cfg.kv_source_layer_ids)}; index sources {list(cfg.index_source_layer_ids)}; "
          f"candidate source {cfg.candidate_source_layer_id}")
    print(f"  engram layers {list(cfg.engram_layer_ids)} rows {list(cfg.engram_num_embeddings)}; "
          f"DSpark stages {cfg.num_nextn_predict_layers} targets "
          f"{list(cfg.dspark_target_layer_ids)}")
    # EXL3: bits per weight from each trellis shape, per tensor group
    from strata.quant.exl3 import bits_per_weight
    kbits: dict[str, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    for name in ckpt.names():
        if name.endswith(".trellis"):
            kbits[_group(name)][bits_per_weight(ckpt.info(name).shape[-1])] += 1
    print(f"  {'group':<20}{'tensors':>9}{'bytes':>16}   EXL3 K (linears)")
    for g, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        ks = ", ".join(f"{k:g}: {c}" for k, c in sorted(kbits[g].items())) if g in kbits else ""
        print(f"  {g:<20}{n:>9}{b:>16,}   {ks}")
    print("  by dtype: " + ", ".join(f"{k} {v:,}" for k, v in sorted(dtypes.items())))
    if not packed:
        print(f"  disk needed to pack it: {pack_bytes(ckpt) / 1e9:.3f} GB "
              f"(strata pack {folder} DST)")
    ckpt.close()
    try:
        check_loadable(folder)
        print("  engine check: the model builds from these headers (every tensor it reads "
              "present, with its dtype and shape)")
    except StrataError as e:
        print(f"  engine check: FAILED: {e}")
    return 0


def cmd_pack(args) -> int:
    from strata.checkpoint.pack import pack, verify_pack
    progress = False if args.quiet else None
    if args.verify:
        if len(args.paths) != 1:
            raise StrataError("strata pack --verify DST: give exactly one pack folder")
        n, nbytes, dt = verify_pack(args.paths[0], progress=progress)
        print(f"{args.paths[0]}: {n} files, {nbytes / 1e9:.3f} GB: every size and {n} "
              f"checksums match the manifest ({nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s)")
        return 0
    if len(args.paths) != 2:
        raise StrataError("strata pack SRC DST: give the checkpoint folder and the pack folder")
    r = pack(args.paths[0], args.paths[1], buffer_bytes=args.buffer_mb << 20,
             progress=progress)
    gbs = r.bytes / 1e9 / max(r.seconds, 1e-9)
    print(f"packed {args.paths[0]} into {r.path}: {r.bytes / 1e9:.3f} GB in "
          f"{len(r.written) + len(r.reused)} files ({len(r.written)} written, {len(r.reused)} "
          f"kept from an earlier run), {r.seconds:.1f} s, {gbs:.2f} GB/s")
    return 0


def cmd_plan(args) -> int:
    from strata.checkpoint.pack import open_checkpoint
    from strata.config import ModelConfig
    from strata.runtime.placement import parse_bytes, plan_placement, tensor_bytes_of
    if (args.dir is None) == (args.synthetic is None):
        raise StrataError("plan needs a checkpoint folder or --synthetic exl3|official")
    if args.synthetic:
        # The published V4.1 config's sizes in that format (built on the meta device: no
        # memory, no checkpoint), the EXL3 mix of strata bench synthetic (≈2.7 bpw).
        from strata.bench.synthetic import v41_tensor_bytes
        from strata.config import v41_flash_config
        cfg = v41_flash_config()
        sizes = v41_tensor_bytes(args.synthetic)
    else:
        folder = Path(args.dir)
        cfg = ModelConfig.from_model_dir(folder)
        with open_checkpoint(folder, verify="none") as ckpt:  # a folder or a pack
            sizes = tensor_bytes_of(ckpt)  # headers only: fails before any weight is read
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    budgets = [parse_bytes(b) for b in args.budget.split(",")]
    plan = plan_placement(cfg, sizes, devices, budgets, args.context,
                          reserve_bytes=parse_bytes(args.reserve), kv_format=args.kv_format,
                          engram_on_device=args.engram_on_device,
                          draft_cache_bytes=None if args.draft_cache is None
                          else parse_bytes(args.draft_cache))
    print(plan.format())
    return 0


def cmd_bench_decode(args) -> int:
    import platform
    from strata.bench.decode import bench_decode, prompt_tokens, report, write_json
    from strata.tokenizer import tokenizer_path
    model = _load(args)
    prompt = prompt_tokens(tokenizer_path(_model_dir(args.model)))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise StrataError(f"--modes {args.modes!r}: no mode named (e.g. plain,dspark,oracle)")
    results = bench_decode(model, prompt, modes, n=args.tokens, runs=args.runs,
                           warmup=args.warmup, length=args.length,
                           progress=lambda line: print(line, file=sys.stderr, flush=True),
                           tokenizer_json=tokenizer_path(_model_dir(args.model)))
    print(report(results, len(prompt)))
    split = None
    if getattr(args, "parallel", None):
        from strata.bench.decode import parallel_split, split_report
        split = parallel_split(model, prompt, modes, n=args.tokens, length=args.length)
        print(split_report(split))
    if args.json:
        dev = torch.device(args.devices.split(",")[0] if getattr(args, "parallel", None)
                           else args.device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda:0")
        meta = {"command": "strata " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda"
                else platform.processor() or platform.machine(),
                "parallel": getattr(args, "parallel", None),
                "devices": getattr(args, "devices", None), "split_timing": split,
                "model": str(_model_dir(args.model)), "prompt_tokens": len(prompt),
                "numerics": model.numerics.mode, "act_dtype": str(model.numerics.act_dtype)}
        write_json(args.json, results, meta)
    return 0


def cmd_bench_synthetic(args) -> int:
    from strata.bench.synthetic import run
    return run(args)


def cmd_bench_pieces(args) -> int:
    from strata.bench.pieces import run
    return run(args)


def cmd_passkey(args) -> int:
    from strata.bench.passkey import as_json, parse_length, report, run_passkey
    from strata.runtime.chunk_size import resolve_prefill_chunk
    from strata.tokenizer import tokenizer_path
    lengths = [parse_length(t) for t in args.lengths.split(",") if t.strip()]
    if not lengths:
        raise StrataError("--lengths: no lengths given")
    model = _load(args)
    chunk = resolve_prefill_chunk(args.prefill_chunk, model, max(lengths) + args.max_tokens)
    results = run_passkey(model, tokenizer_path(_model_dir(args.model)), lengths,
                          depth=args.depth, chunk=chunk, max_tokens=args.max_tokens,
                          seed=args.seed)
    print(report(results))
    if args.json:
        meta = {"command": "strata " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
                "model": str(_model_dir(args.model)), "device": str(model.device),
                "prefill_chunk": chunk}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": as_json(results)},
                                              indent=2))
    return 0


def cmd_bench_kernels(args) -> int:
    from strata.bench.kernels import run_from_args
    return run_from_args(args)


def cmd_serve(args) -> int:
    from strata.serve.server import api_key, check_bind, serve
    check_bind(args.host, api_key(args.api_key))  # before the (long) model load
    _check_speculative_args(args)
    model = _load(args)
    _check_capacity(args, model.cfg)
    return serve(model, _model_dir(args.model), args)


def cmd_make_tiny(args) -> int:
    from strata.checkpoint.tiny import make_tiny
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StrataError(f"make-tiny {out}: exists and is not an empty folder; refusing to "
                          "write into it (name a new folder)")
    out = make_tiny(out, args.preset, args.seed, args.format)
    print(f"wrote {args.preset} {args.format} fixture (seed {args.seed}) to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="DeepSeek-V4.1-Flash inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate tokens from a prompt")
    _add_model_args(g)
    _add_parallel_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a user message, rendered with the V4.1 chat format")
    src.add_argument("--tokens", help="raw prompt token ids (comma or space separated)")
    g.add_argument("--thinking", action="store_true", help="render the prompt in thinking mode")
    g.add_argument("--max-tokens", type=COUNT, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=SEED, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_prefill_chunk_arg(g)
    _add_speculative_args(g)
    _add_graphs_arg(g)
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("score", help="save per-position logits for a token sequence")
    _add_model_args(s)
    s.add_argument("--tokens", required=True)
    s.add_argument("--mode", default="prefill", help="prefill, decode or chunk:N")
    s.add_argument("--start", type=NONNEGATIVE, default=0, help="positions before this are context only")
    s.add_argument("--save", required=True, help="output .npz (logits, tokens, positions)")
    s.set_defaults(fn=cmd_score)

    i = sub.add_parser("inspect", help="describe a checkpoint folder or a pack")
    i.add_argument("dir")
    i.set_defaults(fn=cmd_inspect)

    pk = sub.add_parser("pack", help="convert a checkpoint folder (official or EXL3) into the "
                                     "runtime pack, or check a pack (--verify)")
    pk.add_argument("paths", nargs="+", metavar="SRC DST",
                    help="the checkpoint folder and the pack folder (with --verify: the pack)")
    pk.add_argument("--verify", action="store_true",
                    help="check every file of the pack against the manifest's sizes and "
                         "checksums")
    pk.add_argument("--buffer-mb", type=integer(1, 4096), default=32,
                    help="size of each of the 4 buffers the bytes stream through (default 32)")
    pk.add_argument("--quiet", action="store_true", help="no progress bar")
    pk.set_defaults(fn=cmd_pack)

    pl = sub.add_parser("plan", help="place layers on devices within memory budgets "
                                     "(reads only the checkpoint headers)")
    pl.add_argument("dir", nargs="?", help="checkpoint folder or pack")
    pl.add_argument("--synthetic", choices=["exl3", "official"],
                    help="instead of a folder: the published V4.1-Flash config in this format "
                         "(EXL3 at the bench synthetic mix, ≈2.7 bpw)")
    pl.add_argument("--devices", default="cuda:0", help="comma-separated, in layer order")
    pl.add_argument("--budget", required=True,
                    help="memory per device (96GB, 80GiB, ...): one for all, or one per device")
    pl.add_argument("--context", type=COUNT, default=65536, help="context length to size caches")
    pl.add_argument("--reserve", default="4GiB",
                    help="per-device room for activations, CUDA graphs and the CUDA context")
    pl.add_argument("--kv-format", default="bf16", choices=["bf16", "fp32", "fp4"],
                    help="storage of compressed KV and index keys (fp4: spec §4 packed layout)")
    pl.add_argument("--engram-on-device", action="store_true",
                    help="place the Engram tables with their layers (default: on disk)")
    pl.add_argument("--draft-cache", metavar="SIZE",
                    help="plan for --draft-experts cache: the DSpark stages' experts stay on "
                         "disk behind a draft expert cache of SIZE (e.g. 1GiB)")
    pl.set_defaults(fn=cmd_plan)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bd = bsub.add_parser("decode", help="decode protocol: fixed coding prompt, greedy, "
                                        "modes compared token for token")
    _add_model_args(bd)
    _add_parallel_args(bd)
    bd.add_argument("--modes", default="plain,dspark,oracle",
                    help="comma-separated: plain, dspark, oracle (drafts = plain continuation); "
                         "+json: picks held to a JSON grammar; +graphs: CUDA graphs")
    bd.add_argument("--tokens", type=COUNT, default=96)
    bd.add_argument("--runs", type=COUNT, default=3)
    bd.add_argument("--warmup", type=NONNEGATIVE, default=1)
    bd.add_argument("--length", type=COUNT, default=None,
                    help="fixed verify length for dspark (default: adaptive) and the oracle "
                         "modes (default: the draft block)")
    bd.add_argument("--json", help="write the results as JSON here")
    bd.set_defaults(fn=cmd_bench_decode)
    from strata.bench.kernels import add_arguments as add_bench_kernels_arguments
    bk = bsub.add_parser("kernels", help="EXL3 kernels at the V4.1 shapes (vs exllamav3 when it "
                                         "imports); --smoke: tiny shapes on CPU")
    add_bench_kernels_arguments(bk)
    bk.set_defaults(fn=cmd_bench_kernels)

    from strata.bench.synthetic import add_arguments as add_bench_synthetic_arguments
    bs = bsub.add_parser("synthetic", help="decode speed of the V4.1 shapes and formats with "
                                           "random weights made on the device")
    add_bench_synthetic_arguments(bs)
    bs.set_defaults(fn=cmd_bench_synthetic)
    from strata.bench.pieces import add_arguments as add_bench_pieces_arguments
    bp = bsub.add_parser("pieces", help="the whole model's figures from bench synthetic runs "
                                        "of pieces holding each layer once (times added)")
    add_bench_pieces_arguments(bp)
    bp.set_defaults(fn=cmd_bench_pieces)

    pk = sub.add_parser("passkey", help="long-context retrieval: a pass key at the start, "
                                        "filler, the question at the end")
    _add_model_args(pk)
    pk.add_argument("--lengths", default="32K,128K,262K,524K",
                    help="comma-separated prompt lengths in tokens (K = 1024)")
    pk.add_argument("--depth", type=float, default=0.0,
                    help="where the key sits in the filler, 0 = start .. 1 = end")
    _add_prefill_chunk_arg(pk, "--chunk", auto=True)
    pk.add_argument("--max-tokens", type=COUNT, default=16, help="answer length")
    pk.add_argument("--seed", type=SEED, default=0, help="picks the keys")
    pk.add_argument("--json", help="write the results as JSON here")
    pk.set_defaults(fn=cmd_passkey)

    sv = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server")
    _add_model_args(sv)
    _add_parallel_args(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="bind address (default loopback; others need an API key)")
    sv.add_argument("--port", type=PORT, default=8000)
    sv.add_argument("--api-key", help="required from clients as 'Authorization: Bearer KEY' or "
                                      "'x-api-key: KEY' (default: $STRATA_API_KEY)")
    sv.add_argument("--max-queue", type=NONNEGATIVE, default=16,
                    help="requests that may wait for the engine; more get 429 (default 16)")
    sv.add_argument("--prefix-cache-mb", type=NONNEGATIVE, default=2048,
                    help="memory for retained conversation states (default 2048)")
    sv.add_argument("--max-body-mb", type=COUNT, default=16, help="request size limit")
    _add_prefill_chunk_arg(sv, auto=True)
    sv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                    help="before serving, run two throwaway requests so the kernels compile "
                         "then, not in the first client's request (default: on CUDA)")
    _add_speculative_args(sv)
    _add_graphs_arg(sv)
    sv.add_argument("--drain-timeout", type=NONNEGATIVE, default=300,
                    help="seconds to wait for requests in flight on shutdown")
    sv.add_argument("--log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug", "trace"])
    sv.add_argument("--script", help="test hook: JSON rules of scripted outputs "
                                     "(strata/serve/scripts.py)")
    sv.set_defaults(fn=cmd_serve)

    m = sub.add_parser("make-tiny", help="write a deterministic random fixture checkpoint")
    m.add_argument("out")
    m.add_argument("--preset", default="real-vocab", choices=["tiny", "real-vocab"])
    m.add_argument("--seed", type=SEED, default=0)
    m.add_argument("--format", default="official", choices=["official", "exl3", "exl3-routed"],
                   help="official fp8/fp4, exllamav3's EXL3 convention, or EXL3 routed experts "
                        "only (random trellis data)")
    m.set_defaults(fn=cmd_make_tiny)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a usage error (2), --help (0): argparse has said why
        return e.code if isinstance(e.code, int) else 2
    if getattr(args, "device", None) == "auto":  # (the model commands' default)
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if isinstance(getattr(args, "json", None), str):  # (a results file: before the run)
            _check_writable(args.json, "--json")
        return args.fn(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except (OSError, MemoryError) as e:  # the machine's answer (a path, the memory): no bug
        print(f"strata: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted (a pack resumes where it stopped when run again)",
              file=sys.stderr)
        return 130
    finally:
        if getattr(args, "parallel", None):  # stop the other ranks of a multi-device run
            from strata.runtime.parallel import close_all
            close_all()


if __name__ == "__main__":
    sys.exit(main())
