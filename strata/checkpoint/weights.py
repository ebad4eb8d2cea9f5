"""Read a model's tensors by checkpoint name, validated, onto a device, one tensor at a time.

`WeightReader` is the vocabulary the model code loads with: `tensor(name, dtype, shape)` and
`linear(prefix, out, in)`, which picks the Linear backend from the stored dtype (fp8 + tile
scales, packed fp4 + group scales, or plain bf16/fp32). Every mismatch names the tensor and file.
"""
from __future__ import annotations

import torch

from strata.checkpoint.safetensors_io import CheckpointFolder
from strata.errors import CheckpointError
from strata.quant.linear import DenseLinear, Fp4Group32Linear, Fp8Block32Linear, Linear

SCALE_DTYPES = ("F8_E8M0", "U8")


def _ceil32(n: int) -> int:
    return (n + 31) // 32


class WeightReader:
    def __init__(self, folder: CheckpointFolder, device: torch.device | str = "cpu") -> None:
        self.folder = folder
        self.device = torch.device(device)
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return self.folder.has(name)

    def _where(self, name: str) -> str:
        return f"tensor {name} in {self.folder.info(name).file}"

    def tensor(self, name: str, dtype: str | tuple[str, ...] | None = None,
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The stored tensor, checked against the expected dtype(s) and shape, on the device."""
        if not self.folder.has(name):
            raise CheckpointError(f"tensor {name} is missing from the checkpoint {self.folder.path}")
        info = self.folder.info(name)
        if dtype is not None:
            allowed = (dtype,) if isinstance(dtype, str) else dtype
            if info.dtype not in allowed:
                raise CheckpointError(f"{self._where(name)} has dtype {info.dtype}; expected "
                                      f"{' or '.join(allowed)}")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise CheckpointError(f"{self._where(name)} has shape {list(info.shape)}; expected "
                                  f"{list(shape)}")
        self.used.add(name)
        return self.folder.read(name).to(self.device)

    def float_tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A BF16/F32 tensor (norm weights, biases, mHC parameters) as fp32."""
        return self.tensor(name, ("BF16", "F32", "F16"), shape).float()

    def linear(self, prefix: str, out_features: int, in_features: int) -> Linear:
        name = f"{prefix}.weight"
        if not self.folder.has(name):
            raise CheckpointError(f"tensor {name} is missing from the checkpoint {self.folder.path}")
        dt = self.folder.info(name).dtype
        if dt == "F8_E4M3":
            w = self.tensor(name, dt, (out_features, in_features))
            s = self.tensor(f"{prefix}.scale", SCALE_DTYPES,
                            (_ceil32(out_features), _ceil32(in_features)))
            return Fp8Block32Linear(w, s)
        if dt == "I8":
            if in_features % 32:
                raise CheckpointError(f"{self._where(name)}: fp4 input dim {in_features} is not "
                                      "a multiple of 32")
            w = self.tensor(name, dt, (out_features, in_features // 2))
            s = self.tensor(f"{prefix}.scale", SCALE_DTYPES, (out_features, in_features // 32))
            return Fp4Group32Linear(w, s)
        if dt in ("BF16", "F32", "F16"):
            if self.folder.has(f"{prefix}.scale"):
                raise CheckpointError(f"{self._where(name)} has dtype {dt} but a scale tensor "
                                      f"{prefix}.scale stands beside it: a quantized weight "
                                      "(F8_E4M3 or I8) was expected")
            return DenseLinear(self.tensor(name, dt, (out_features, in_features)))
        raise CheckpointError(f"{self._where(name)} has dtype {dt}; expected F8_E4M3 (+scale), "
                              "I8 packed fp4 (+scale), BF16 or F32")
