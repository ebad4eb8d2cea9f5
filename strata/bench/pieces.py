"""The whole model's figures from `strata bench synthetic` runs of its pieces (`strata bench
pieces`).

One GPU does not hold all 40 layers of the synthetic V4.1-Flash, but a layer split runs a
sequence's layers one device after another: a decode step's time, and a prefill's, is the sum
of its layers' times. So runs of pieces that together hold every layer once add up to the
whole model on one GPU — closer than a fit subset scaled per layer, whose decoder layers run
more prefill rows than the model's average and whose head is counted 40/held times.

A piece must be a valid one-device subset (bench synthetic checks it): layers 24, 28, 32 and
36 pick among layer 20's candidate blocks, so the piece holding them holds layer 20 too, and
a run of the overlap alone (`--subtract`) takes it out again. The pieces must cover each layer
exactly once after subtraction, and come from the same device and format with the same modes
and prefill lengths (the prompt and token counts are the caller's to keep alike: the files do
not record them).

What the sum counts more than once: each piece runs the output head (V4.1's vocabulary
projection, 0.66 G weights: about 4 % of the weights a 40-layer plain token decodes), embeds,
samples and (in DSpark windows) drafts, so the combined decode is slower than the model's by
the pieces added beyond one net of those subtracted (`extra_heads`). A window's tokens depend on
the drafts of the piece's own last layers, not the model's (each piece's mean tokens a window
is reported): the windows' sums are estimates. The roofline columns (what a token reads and
decodes, bench synthetic's step_traffic) add the same way, against the first piece's measured
copy bandwidth and kernel rate.
"""
from __future__ import annotations

import json
from pathlib import Path

from strata.errors import StrataError


def load(path: str | Path) -> dict:
    """A bench synthetic --json file, with its layers checked to be named."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise StrataError(f"bench pieces: cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) \
            or not isinstance(data.get("results"), dict):
        raise StrataError(f"bench pieces: {path} is not a `strata bench synthetic --json` file")
    if data["meta"].get("parallel"):
        raise StrataError(f"bench pieces: {path} is a --parallel run (every layer already)")
    if data["meta"].get("layers") is None:
        raise StrataError(f"bench pieces: {path} holds every layer: a piece names its "
                          "--layers")
    return data


def _protocol(data: dict) -> tuple:
    """What must match between pieces: device, format, modes, prefill lengths, skip and chunk
    (`--prefill-chunk auto` may pick different chunks for pieces of different sizes)."""
    meta = data["meta"]
    prefill = tuple((r["tokens"], r["decoder_skip"], r.get("chunk"))
                    for r in data.get("prefill") or [])
    return (meta.get("device"), meta.get("format"), tuple(sorted(data["results"])), prefill)


def combine(add: list[tuple[str, dict]], subtract: list[tuple[str, dict]],
            n_layers: int) -> dict:
    """The whole model's decode tok/s per mode and prefill seconds per length from pieces
    (name, data): Σ over `add` minus Σ over `subtract` of seconds per token (decode) and of
    seconds (prefill). Raises StrataError naming what does not add up."""
    if not add:
        raise StrataError("bench pieces: no piece to add")
    count = [0] * n_layers
    for sign, group in ((1, add), (-1, subtract)):
        for name, data in group:
            for layer in data["meta"]["layers"]:
                if not 0 <= layer < n_layers:
                    raise StrataError(f"bench pieces: {name} holds layer {layer}; the model "
                                      f"has {n_layers}")
                count[layer] += sign
    wrong = {l: c for l, c in enumerate(count) if c != 1}
    if wrong:
        shown = ", ".join(f"layer {l} {c}×" for l, c in sorted(wrong.items())[:8])
        raise StrataError(f"bench pieces: the pieces must hold each of the {n_layers} layers "
                          f"once after subtraction; they hold {shown}"
                          + (" …" if len(wrong) > 8 else ""))
    base_name, base = add[0]
    for name, data in add[1:] + subtract:
        if _protocol(data) != _protocol(base):
            raise StrataError(f"bench pieces: {name} was not measured as {base_name} was "
                              f"(device, format, modes, prefill lengths and chunks must "
                              f"match): "
                              f"{_protocol(data)} against {_protocol(base)}")
    pieces = [(1, n, d) for n, d in add] + [(-1, n, d) for n, d in subtract]
    decode = {}
    for mode in sorted(base["results"]):
        per_token = sum(sign / d["results"][mode]["median_tok_per_s"] for sign, _, d in pieces)
        if per_token <= 0:
            raise StrataError(f"bench pieces: {mode}: the subtracted pieces take longer than "
                              "the added ones")
        decode[mode] = {
            "tok_per_s": 1 / per_token,
            "estimate": any(d["results"][mode]["windows"] for _, _, d in pieces),
            "tokens_per_window": {n: d["results"][mode]["mean_committed_per_window"]
                                  for _, n, d in pieces if d["results"][mode]["windows"]}}
    prefill = []
    for i, row in enumerate(base.get("prefill") or []):
        seconds = sum(sign * d["prefill"][i]["seconds"] for sign, _, d in pieces)
        if seconds <= 0:
            raise StrataError(f"bench pieces: prefill {row['tokens']}: the subtracted pieces "
                              "take longer than the added ones")
        prefill.append({"tokens": row["tokens"], "decoder_skip": row["decoder_skip"],
                        "chunk": row.get("chunk"),
                        "seconds": seconds, "tok_per_s": row["tokens"] / seconds,
                        "peak_device_bytes": max(
                            (d["prefill"][i].get("peak_device_bytes") or 0
                             for _, _, d in pieces), default=0)})
    roofline = {}
    rates = base.get("rates")
    if rates and all(d.get("roofline") for _, _, d in pieces):
        for mode, r in decode.items():
            gb = sum(sign * d["roofline"][mode]["gb_per_token"] for sign, _, d in pieces)
            gw = sum(sign * d["roofline"][mode]["gweights_per_token"] for sign, _, d in pieces)
            tok = r["tok_per_s"]
            roofline[mode] = {"gb_per_token": gb, "gweights_per_token": gw,
                              "gb_per_s": gb * tok,
                              "of_copy": gb * tok / rates["copy_gb_per_s"],
                              "tweights_per_s": gw * tok / 1e3,
                              "of_kernel": gw * 1e9 * tok / rates["linear_weights_per_s"]}
    return {"device": base["meta"].get("device"), "format": base["meta"].get("format"),
            "add": [n for n, _ in add], "subtract": [n for n, _ in subtract],
            "layers": n_layers, "extra_heads": len(add) - len(subtract) - 1,
            "decode": decode, "prefill": prefill, "roofline": roofline, "rates": rates}


def report(c: dict) -> str:
    lines = [f"{c['layers']} layers from pieces {' + '.join(c['add'])}"
             + (f" − {' − '.join(c['subtract'])}" if c["subtract"] else "")
             + f" ({c['device']}, {c['format']}): times added; the output head and sampling "
             f"counted {c['extra_heads']} time(s) more than the model runs them"]
    for mode, r in c["decode"].items():
        note = ""
        if r["estimate"]:
            note = ("  (estimate: tokens a window by piece " + ", ".join(
                f"{n} {v:.2f}" for n, v in r["tokens_per_window"].items()) + ")")
        roof = c["roofline"].get(mode)
        if roof:
            note = (f"; {roof['gb_per_token']:.2f} GB, {roof['gweights_per_token']:.2f} G "
                    f"weights a token: {roof['of_copy']:.1%} of copy bandwidth, "
                    f"{roof['of_kernel']:.1%} of the kernel's rate") + note
        lines.append(f"  {mode}: {r['tok_per_s']:.1f} tok/s{note}")
    for r in c["prefill"]:
        skip = "skip on" if r["decoder_skip"] else "skip off"
        chunk = f", {r['chunk']}-row chunks" if r.get("chunk") else ""
        lines.append(f"  prefill {r['tokens']} ({skip}{chunk}): {r['seconds']:.3f} s, "
                     f"{r['tok_per_s']:.0f} tok/s; largest piece's peak "
                     f"{r['peak_device_bytes'] / 2**30:.1f} GiB")
    return "\n".join(lines)


def run(args) -> int:
    from strata.config import ModelConfig, v41_flash_config
    cfg = ModelConfig.from_model_dir(Path(args.config)) if args.config else v41_flash_config()
    c = combine([(Path(p).stem, load(p)) for p in args.add],
                [(Path(p).stem, load(p)) for p in args.subtract or []], cfg.n_layers)
    print(report(c))
    if args.json:
        Path(args.json).write_text(json.dumps(c, indent=2))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--add", nargs="+", required=True, metavar="JSON",
                   help="bench synthetic --json files of the pieces")
    p.add_argument("--subtract", nargs="*", metavar="JSON",
                   help="runs of layers the added pieces hold twice (e.g. layer 20 alone)")
    p.add_argument("--config", help="model config folder (default: V4.1-Flash's)")
    p.add_argument("--json", help="write the combined figures as JSON here")
