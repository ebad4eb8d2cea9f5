"""strata bench pieces: the whole model's figures from bench synthetic runs of its pieces."""
import json

import pytest

from strata.bench import pieces
from strata.cli import main
from strata.errors import StrataError


def piece(layers, plain, window, prefill_s, device="NVIDIA H100 80GB HBM3", committed=2.7,
          chunk=4096):
    """A bench synthetic --json file's fields that bench pieces reads (a token's traffic: 0.4
    GB and 1 G weights a layer, the head 0.5 GB and 0.66 G weights)."""
    n = 0 if layers is None else len(layers)
    roof = {"gb_per_token": 0.4 * n + 0.5, "gweights_per_token": 1.0 * n + 0.66}
    return {"meta": {"layers": layers, "device": device, "format": "exl3", "parallel": None},
            "rates": {"copy_gb_per_s": 3000.0, "linear_weights_per_s": 4e12},
            "roofline": {"plain+graphs": roof, "oracle+graphs": roof},
            "results": {
                "plain+graphs": {"median_tok_per_s": plain, "windows": 0,
                                 "mean_committed_per_window": 1.0},
                "oracle+graphs": {"median_tok_per_s": window, "windows": 10,
                                  "mean_committed_per_window": committed}},
            "prefill": [{"tokens": 32768, "decoder_skip": True, "seconds": prefill_s,
                         "chunk": chunk, "peak_device_bytes": int(60e9)}]}


def write(tmp_path, name, data):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def session51(tmp_path):
    """Session 51's four pieces of the 40 layers (their decode and 32K prefill figures)."""
    return ([write(tmp_path, "a", piece(list(range(0, 14)), 299.3, 609.5, 2.206)),
             write(tmp_path, "b", piece(list(range(14, 28)), 292.9, 606.5, 1.0942)),
             write(tmp_path, "c", piece([20] + list(range(28, 40)), 321.6, 658.9, 0.1445))],
            [write(tmp_path, "d", piece([20], 1655.2, 1872.0, 0.0391))])


def test_pieces_add_their_times_and_subtract_the_overlap(tmp_path, capsys):
    add, sub = session51(tmp_path)
    out = tmp_path / "whole.json"
    assert main(["bench", "pieces", "--add", *add, "--subtract", *sub, "--json", str(out)]) == 0
    c = json.loads(out.read_text())
    plain = 1 / (1 / 299.3 + 1 / 292.9 + 1 / 321.6 - 1 / 1655.2)
    assert c["decode"]["plain+graphs"]["tok_per_s"] == pytest.approx(plain)
    assert round(c["decode"]["plain+graphs"]["tok_per_s"], 1) == 108.0
    assert not c["decode"]["plain+graphs"]["estimate"]
    # a window's figure depends on each piece's own drafts: marked, with their tokens a window
    assert c["decode"]["oracle+graphs"]["estimate"]
    assert c["decode"]["oracle+graphs"]["tokens_per_window"] == {n: 2.7 for n in "abcd"}
    (p,) = c["prefill"]
    assert p["seconds"] == pytest.approx(2.206 + 1.0942 + 0.1445 - 0.0391)
    assert round(p["tok_per_s"]) == 9622 and p["chunk"] == 4096
    assert (c["add"], c["subtract"], c["layers"]) == (["a", "b", "c"], ["d"], 40)
    # what a token reads and decodes adds the same way: 40 layers and the head counted twice
    # (three pieces' heads less the subtracted one's: one more than the model runs)
    assert c["extra_heads"] == 1
    roof = c["roofline"]["plain+graphs"]
    assert roof["gweights_per_token"] == pytest.approx(40 * 1.0 + 2 * 0.66)
    assert roof["gb_per_token"] == pytest.approx(40 * 0.4 + 2 * 0.5)
    assert roof["of_kernel"] == pytest.approx(41.32e9 * plain / 4e12)
    assert roof["of_copy"] == pytest.approx(17.0 * plain / 3000.0)
    text = capsys.readouterr().out
    assert "plain+graphs: 108.0 tok/s" in text and "9622 tok/s" in text
    assert "prefill 32768 (skip on, 4096-row chunks)" in text


def test_each_layer_must_be_held_once(tmp_path):
    add, sub = session51(tmp_path)
    with pytest.raises(StrataError, match="layer 20 2×"):
        pieces.combine([(p, pieces.load(p)) for p in add], [], 40)
    with pytest.raises(StrataError, match="layer 0 0×, layer 1 0×"):
        pieces.combine([(p, pieces.load(p)) for p in add[1:]],
                       [(p, pieces.load(p)) for p in sub], 40)
    with pytest.raises(StrataError, match="holds layer 40; the model has 40"):
        bad = write(tmp_path, "e", piece([40], 1000.0, 1000.0, 0.01))
        pieces.combine([(p, pieces.load(p)) for p in add + [bad]],
                       [(p, pieces.load(p)) for p in sub], 40)


def test_pieces_must_be_measured_alike(tmp_path):
    add, sub = session51(tmp_path)
    other = write(tmp_path, "c2", piece([20] + list(range(28, 40)), 321.6, 658.9, 0.1445,
                                        device="NVIDIA H200"))
    with pytest.raises(StrataError, match="c2 was not measured as a was"):
        pieces.combine([(n, pieces.load(p)) for n, p in zip("ab", add[:2])]
                       + [("c2", pieces.load(other))], [("d", pieces.load(sub[0]))], 40)
    # (--prefill-chunk auto can pick a bigger chunk for a smaller piece: not comparable)
    bigger = write(tmp_path, "c3", piece([20] + list(range(28, 40)), 321.6, 658.9, 0.1445,
                                         chunk=8192))
    with pytest.raises(StrataError, match="c3 was not measured as a was.*chunks must match"):
        pieces.combine([(n, pieces.load(p)) for n, p in zip("ab", add[:2])]
                       + [("c3", pieces.load(bigger))], [("d", pieces.load(sub[0]))], 40)


def test_files_that_are_not_pieces_are_refused(tmp_path):
    everything = piece(None, 100.0, 200.0, 3.0)
    parallel = dict(piece(list(range(40)), 100.0, 200.0, 3.0))
    parallel["meta"] = dict(parallel["meta"], parallel="layer")
    garbage = tmp_path / "g.json"
    garbage.write_text("{not json")
    for path, match in ((write(tmp_path, "all", everything), "holds every layer"),
                        (write(tmp_path, "par", parallel), "--parallel run"),
                        (str(garbage), "cannot read"),
                        (write(tmp_path, "list", [1, 2]), "not a `strata bench synthetic")):
        with pytest.raises(StrataError, match=match):
            pieces.load(path)
    assert main(["bench", "pieces", "--add", str(garbage)]) != 0
