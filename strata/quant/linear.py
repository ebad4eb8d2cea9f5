"""Every weight matmul goes through one Linear interface, whatever the stored format.

Backends hold the checkpoint's stored tensors unchanged (fp8 bytes + ue8m0 tile scales, packed
fp4 + per-32 scales, or plain bf16/fp32) and expose `forward(x, numerics)` and `dequantize()`.
This torch reference dequantizes once and keeps the dense copy (`materialize`); on CUDA the
fp8/fp4 backends' `forward` runs the Triton kernels of strata.kernels.fp8fp4 on the stored bytes
instead (no dense copy; CPU keeps the reference unless the kernels are forced for tests).
In vendor numerics, fp8/fp4 GEMMs first quantise the activation to fp8 per 32 along K.
"""
from __future__ import annotations

import torch

from strata.checkpoint.encodings import dequant_fp4_group, dequant_fp8_block
from strata.model.numerics import Numerics, row_matmul
from strata.quant.qdq import fp8_act_qdq


class Linear:
    """y = x·Wᵀ for W [out_features, in_features]."""

    quantized_activations = False  # vendor mode quantises x to fp8 before this GEMM
    stored_dtype: torch.dtype | None = None  # a 16-bit float weight stored as is (DenseLinear)

    def __init__(self, out_features: int, in_features: int) -> None:
        self.out_features = out_features
        self.in_features = in_features
        self._dense: dict[torch.dtype, torch.Tensor] = {}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def materialize(self, dtype: torch.dtype) -> torch.Tensor:
        w = self._dense.get(dtype)
        if w is None:
            w = self.dequantize(dtype)
            self._dense[dtype] = w
        return w

    def rows(self, lo: int, hi: int) -> "Linear":
        """The linear of output rows lo..hi-1 (e.g. one group of the grouped wo_a)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, nx: Numerics, out_dtype: torch.dtype | None = None,
                act_quant: bool = True) -> torch.Tensor:
        """`act_quant=False` skips the vendor fp8 activation point (wo_a runs unquantized)."""
        if nx.quantize and self.quantized_activations and act_quant:
            x = fp8_act_qdq(x)
        # An fp32 output (gate, head, compressor) is also computed in fp32.
        cd = torch.float32 if out_dtype == torch.float32 else nx.act_dtype
        if cd == torch.float32 and x.dtype == self.stored_dtype:
            # x and the stored weight one 16-bit type: their fp32 products are the pairs'
            # exact products, so no fp32 copy of the weight (on CUDA: tensor cores, rowwise)
            return row_matmul(x, self.materialize(x.dtype), cd).to(out_dtype)
        w = self.materialize(cd)
        if cd == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
            # widening is exact and the row products read 16-bit operands into fp32
            # themselves: no cast launch (the same values as x.to(cd))
            y = row_matmul(x, w, cd)
        else:
            y = row_matmul(x.to(cd), w)
        return y.to(out_dtype or nx.act_dtype)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)  # the subclass's forward, always

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    """A bf16/fp32 weight stored as is (norm-free projections, gate, head, compressor)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(*weight.shape)
        self.weight = weight
        if weight.dtype in (torch.bfloat16, torch.float16):
            self.stored_dtype = weight.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def rows(self, lo: int, hi: int) -> Linear:
        return DenseLinear(self.weight[lo:hi])

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class StoredScaledLinear(Linear):
    """A weight kept as its stored bytes + ue8m0 scales (`weight`, `scale`): on CUDA (or when
    forced) the Triton kernel multiplies from those bytes (strata.kernels.fp8fp4); on CPU the
    reference above."""

    quantized_activations = True
    stored_format = ""  # "fp8" | "fp4": how kernels.fp8fp4 reads the bytes
    # The kernel configuration to keep, when this is a slice of a bigger weight (tensor
    # parallelism): the whole weight's, so each output row sums in the same order.
    kernel_config = None

    def forward(self, x: torch.Tensor, nx: Numerics, out_dtype: torch.dtype | None = None,
                act_quant: bool = True) -> torch.Tensor:
        from strata.kernels import fp8fp4
        if fp8fp4.kernels_enabled(x):
            return fp8fp4.linear_forward(self.weight, self.scale, self.stored_format, x, nx,
                                         out_dtype, act_quant, self.kernel_config)
        return super().forward(x, nx, out_dtype, act_quant)

    def config_of_whole(self):
        """This weight's kernel configuration (its own, or the whole weight's it was cut from)."""
        from strata.kernels import fp8fp4
        return self.kernel_config or fp8fp4.config_for(fp8fp4.FORMATS[self.stored_format],
                                                       self.out_features, self.in_features)


class Fp8Block32Linear(StoredScaledLinear):
    """fp8 e4m3 weight with one ue8m0 scale per 32×32 tile (official dense format)."""

    stored_format = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(*weight.shape)
        self.weight, self.scale = weight, scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequant_fp8_block(self.weight, self.scale).to(dtype)

    def rows(self, lo: int, hi: int) -> Linear:
        if lo % 32 or (hi % 32 and hi != self.out_features):
            raise ValueError(f"fp8 rows {lo}..{hi} do not fall on 32-row tiles")
        return Fp8Block32Linear(self.weight[lo:hi], self.scale[lo // 32:(hi + 31) // 32])

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel()


class Fp4Group32Linear(StoredScaledLinear):
    """fp4 e2m1 weight packed two per byte, ue8m0 scale per 32 along K (official experts)."""

    stored_format = "fp4"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__(weight.shape[0], weight.shape[1] * 2)
        self.weight, self.scale = weight, scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequant_fp4_group(self.weight, self.scale).to(dtype)

    def rows(self, lo: int, hi: int) -> Linear:
        return Fp4Group32Linear(self.weight[lo:hi], self.scale[lo:hi])

    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel()
