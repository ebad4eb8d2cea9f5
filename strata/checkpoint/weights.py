"""Read a model's tensors by checkpoint name, validated, onto a device, one tensor at a time.

`WeightReader` is the vocabulary the model code loads with: `tensor(name, dtype, shape)` and
`linear(prefix, out, in)`, which picks the Linear backend from the stored dtype (fp8 + tile
scales, packed fp4 + group scales, or plain bf16/fp32). Every mismatch names the tensor and file.

The folder may be a checkpoint folder or a runtime pack (strata.checkpoint.pack.PackFolder),
which answers by the same names. `stacked(prefix, name, E)` gives the routed experts' tensors
as one [E, ...] device tensor — one read from a pack, which stores them stacked
(`is_stacked`), E reads into one allocation from a checkpoint folder. Engram record columns
of a pack are read in whole-record chunks, both columns in one pass.
"""
from __future__ import annotations

import torch

from strata.checkpoint.loader import TensorLoader
from strata.checkpoint.pack import RecordColumnInfo
from strata.checkpoint.safetensors_io import ST_DTYPES, CheckpointFolder, TensorInfo
from strata.errors import CheckpointError
from strata.quant.linear import DenseLinear, Fp4Group32Linear, Fp8Block32Linear, Linear

SCALE_DTYPES = ("F8_E8M0", "U8")


def _ceil32(n: int) -> int:
    return (n + 31) // 32


class WeightReader:
    def __init__(self, folder: CheckpointFolder, device: torch.device | str = "cpu",
                 loader: TensorLoader | None = None) -> None:
        self.folder = folder
        self.device = torch.device(device)
        # Every tensor streams to the device through the loader's bounded staging pool (no
        # shard and no host copy of weights kept). The caller closes a loader it passes in.
        self.loader = loader or TensorLoader(self.device)
        if self.loader.device != self.device:
            raise ValueError(f"loader targets {self.loader.device}, reader {self.device}")
        self.used: set[str] = set()
        self._by_prefix: dict[str, set[str]] | None = None
        # The other column of an Engram record file read in the same pass, until asked for.
        self._spare_columns: dict[str, torch.Tensor] = {}

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
        if isinstance(info, RecordColumnInfo):  # an Engram table in a pack's record file
            return self._record_column(info)
        return self.loader.load(info)

    def host_scalar(self, name: str, dtype: str) -> int:
        """The first element of a small stored tensor (a marker's value), read on the host:
        what the loader decides by (no device round trip, and a meta dry run can read it)."""
        info = self.folder.info(name)
        if info.dtype != dtype or info.nbytes > 64:
            raise CheckpointError(f"{self._where(name)} is {info.dtype} {list(info.shape)}; "
                                  f"expected a small {dtype} tensor")
        self.used.add(name)
        return int(self.folder.read(name).reshape(-1)[0])

    def _record_column(self, info: RecordColumnInfo) -> torch.Tensor:
        """A column (values or scales) of a packed record file, on the device: whole records
        stream through the loader in chunks of about one staging buffer, and every column of
        the table is cut out of them in the same pass (the other is kept until asked for)."""
        spare = self._spare_columns.pop(info.name, None)
        if spare is not None:
            return spare
        cols = [self.folder.info(f"{info.table}.{part}") for part in ("weight", "scale")]
        if not all(isinstance(c, RecordColumnInfo) and c.file == info.file for c in cols):
            raise CheckpointError(f"{info.file}: Engram table {info.table} is not one record file")
        n, stride = info.shape[0], info.row_stride
        outs = [torch.empty(c.shape, dtype=ST_DTYPES[c.dtype][0], device=self.device)
                for c in cols]
        per = max(1, self.loader.buffer_bytes // stride)
        tmp = torch.empty(min(per, n) * stride, dtype=torch.uint8, device=self.device)
        for r0 in range(0, n, per):
            r1 = min(n, r0 + per)
            piece = TensorInfo(f"{info.table} records {r0}..{r1 - 1}", "U8",
                               ((r1 - r0) * stride,), info.file, info.base + r0 * stride,
                               (r1 - r0) * stride)
            recs = self.loader.load_into(piece, tmp[:(r1 - r0) * stride]).view(r1 - r0, stride)
            for c, out in zip(cols, outs):
                width = c.nbytes // n
                out.view(torch.uint8).view(n, width)[r0:r1].copy_(
                    recs[:, c.column:c.column + width])
        for c, out in zip(cols, outs):
            if c.name != info.name:
                self._spare_columns[c.name] = out
        return outs[[c.name for c in cols].index(info.name)]

    def is_stacked(self, prefix: str, name: str) -> bool:
        """Whether the folder stores `<prefix>.{e}.<name>` stacked over e (a pack does)."""
        stacked_info = getattr(self.folder, "stacked_info", None)
        return stacked_info is not None and stacked_info(f"{prefix}.{name}") is not None

    def stacked(self, prefix: str, name: str, n_experts: int,
                dtype: str | tuple[str, ...] | None = None,
                shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """`<prefix>.{e}.<name>` for e < n_experts as one [E, ...] tensor on the device, e.g.
        stacked("layers.3.ffn.experts", "w1.trellis", 256); `shape` is one expert's. Bytes as
        stored: from a pack one read of the stacked tensor, else one read per expert into it."""
        names = [f"{prefix}.{e}.{name}" for e in range(n_experts)]
        for n in names:
            if not self.folder.has(n):
                raise CheckpointError(f"tensor {n} is missing from the checkpoint "
                                      f"{self.folder.path}")
        infos = [self.folder.info(n) for n in names]
        allowed = None if dtype is None else ((dtype,) if isinstance(dtype, str) else dtype)
        for i in infos:
            if (allowed is not None and i.dtype not in allowed) or i.dtype != infos[0].dtype:
                raise CheckpointError(f"{self._where(i.name)} has dtype {i.dtype}; expected "
                                      f"{' or '.join(allowed or (infos[0].dtype,))}")
            want = tuple(shape) if shape is not None else infos[0].shape
            if tuple(i.shape) != want:
                raise CheckpointError(f"{self._where(i.name)} has shape {list(i.shape)}; "
                                      f"expected {list(want)}")
        self.used.update(names)
        whole = getattr(self.folder, "stacked_info", lambda _: None)(f"{prefix}.{name}")
        if whole is not None and whole.shape[0] == n_experts:
            return self.loader.load(whole)
        out = torch.empty((n_experts, *infos[0].shape), dtype=ST_DTYPES[infos[0].dtype][0],
                          device=self.device)
        for e, i in enumerate(infos):
            self.loader.load_into(i, out[e])
        return out

    def float_tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A BF16/F32 tensor (norm weights, biases, mHC parameters) as fp32."""
        return self.tensor(name, ("BF16", "F32", "F16"), shape).float()

    def linear(self, prefix: str, out_features: int, in_features: int) -> Linear:
        if self.folder.has(f"{prefix}.trellis"):
            return self._exl3(prefix, out_features, in_features)
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

    def linear_groups(self, prefix: str, groups: int, out_per_group: int,
                      in_features: int) -> list[Linear]:
        """A row-grouped linear (wo_a): EXL3 stores one slice per group (`prefix.slice.g`),
        the official format one tensor whose row blocks are the groups."""
        if self.folder.has(f"{prefix}.slice.0.trellis"):
            return [self.linear(f"{prefix}.slice.{g}", out_per_group, in_features)
                    for g in range(groups)]
        full = self.linear(prefix, groups * out_per_group, in_features)
        return [full.rows(g * out_per_group, (g + 1) * out_per_group) for g in range(groups)]

    def _suffixes(self) -> dict[str, set[str]]:
        """Tensor-name suffixes by module prefix (built once, to spot stray tensors)."""
        if self._by_prefix is None:
            self._by_prefix = {}
            for n in self.folder.names():
                head, _, tail = n.rpartition(".")
                self._by_prefix.setdefault(head, set()).add(tail)
        return self._by_prefix

    def _exl3(self, prefix: str, out_features: int, in_features: int) -> Linear:
        """An EXL3 linear: trellis + suh + svh (+ codebook marker, + bias), padded to 128."""
        from strata.quant.exl3 import Exl3Linear, bits_per_weight, codebook_from_marker
        name = f"{prefix}.trellis"
        info = self.folder.info(name)
        kp, np_ = -(-in_features // 128) * 128, -(-out_features // 128) * 128
        if info.dtype != "I16" or len(info.shape) != 3 or tuple(info.shape[:2]) != (kp // 16, np_ // 16):
            raise CheckpointError(f"{self._where(name)} is {info.dtype} {list(info.shape)}; expected "
                                  f"I16 [{kp // 16}, {np_ // 16}, 16·K] for a {in_features}→"
                                  f"{out_features} linear padded to 128")
        try:
            bits_per_weight(info.shape[2])
        except ValueError as e:
            raise CheckpointError(f"{self._where(name)}: {e}") from None
        for part in ("suh", "svh"):
            if not self.folder.has(f"{prefix}.{part}"):
                raise CheckpointError(f"EXL3 linear {prefix} in {info.file} has a trellis but no "
                                      f".{part}")
        suh = self.tensor(f"{prefix}.suh", ("F16",), (kp,))
        svh = self.tensor(f"{prefix}.svh", ("F16",), (np_,))
        markers = [m for m in ("mcg", "mul1") if self.folder.has(f"{prefix}.{m}")]
        if len(markers) > 1:
            raise CheckpointError(f"EXL3 linear {prefix} in {info.file} has both .mcg and .mul1")
        unknown = sorted(self._suffixes().get(prefix, set())
                         - {"trellis", "suh", "svh", "mcg", "mul1", "bias"})
        if unknown:
            raise CheckpointError(f"EXL3 linear {prefix} in {info.file}: unknown tensor(s) "
                                  f"{', '.join(unknown)} (unknown codebook marker?)")
        marker = markers[0] if markers else None
        value = self.host_scalar(f"{prefix}.{marker}", "I32") if marker else None
        codebook = codebook_from_marker(marker, value, f"EXL3 linear {prefix} in {info.file}")
        bias = (self.tensor(f"{prefix}.bias", ("F16", "F32"), (out_features,))
                if self.folder.has(f"{prefix}.bias") else None)
        trellis = self.tensor(name, "I16")
        return Exl3Linear(trellis, suh, svh, codebook, out_features, in_features, bias)
