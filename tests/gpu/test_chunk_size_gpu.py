"""`--prefill-chunk auto` on a GPU (runtime/chunk_size.py): a real scratch measured, the state
freed afterwards, the choice following the memory left, and a prefill at the chosen chunk
staying within the scratch the choice predicted for it."""
from __future__ import annotations

import pytest
import torch

from conftest import record
from strata.model.indexer import SCORE_SCRATCH
from strata.runtime.chunk_size import SLACK_BYTES, choose_prefill_chunk
from strata.runtime.session import Session

pytestmark = pytest.mark.gpu

# Encoder layers (two window-only, two compressed with an indexer) and the decoder's first
# two (the ratio-1 candidate source and a reindexing layer): each kind of layer's scratch.
LAYERS = [0, 1, 2, 3, 20, 21]
CONTEXT = 32768


@pytest.fixture(scope="module")
def model(cuda):
    from strata.bench.synthetic import build_synthetic
    from strata.config import v41_flash_config
    return build_synthetic(v41_flash_config(), cuda, layers=LAYERS, fmt="exl3")[0]


def test_auto_measures_the_chunk_and_frees_its_state(model, cuda):
    roomy = choose_prefill_chunk(model, CONTEXT + 8)
    torch.cuda.synchronize(cuda)
    held = torch.cuda.memory_allocated(cuda)  # (after the first: kernels' lazy buffers made)
    (scratch,), (free,) = roomy.scratch, roomy.free
    assert 0 < scratch < free
    assert roomy.keep == [SCORE_SCRATCH + SLACK_BYTES]
    assert roomy.chunk == 8192, roomy.describe()  # (six layers leave a GPU's memory roomy)
    # a prefix cache budget leaving less than the doubled scratch: the base chunk
    tight = free - 2 * scratch - SCORE_SCRATCH - SLACK_BYTES + scratch // 2
    assert choose_prefill_chunk(model, CONTEXT + 8, keep_bytes=tight).chunk == 4096
    torch.cuda.synchronize(cuda)
    assert torch.cuda.memory_allocated(cuda) == held  # (each measurement's state is gone)

    # The chosen chunk's real scratch over a whole prompt — its last chunk at a 24K position,
    # where the indexer's score pieces have grown — within the prediction: the base chunk's
    # scratch scaled by the rows, plus the score pieces' bound.
    session = Session(model, CONTEXT + 8, roomy.chunk)
    torch.cuda.synchronize(cuda)
    before = torch.cuda.memory_allocated(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    tokens = torch.randint(0, model.cfg.vocab_size, (CONTEXT,),
                           generator=torch.Generator().manual_seed(1))
    session.prefill(tokens)
    torch.cuda.synchronize(cuda)
    used = torch.cuda.max_memory_allocated(cuda) - before
    predicted = scratch * roomy.chunk // roomy.base
    record(test="chunk_size", device=torch.cuda.get_device_name(cuda), layers=LAYERS,
           base=roomy.base, base_scratch=scratch, free=free, chunk=roomy.chunk,
           chunk_scratch_at_32k=used, predicted=predicted, score_scratch=SCORE_SCRATCH)
    assert used <= predicted + SCORE_SCRATCH, (used, predicted)
