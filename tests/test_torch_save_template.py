"""The cached records around a tensor's elements give ``torch.save``'s own bytes."""

from __future__ import annotations

import io

import pytest
import torch

from cloudckpt.strategies._dcp_storage import _without_zip_crc32
from cloudckpt.strategies._torch_save_template import TemplateCache

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (1024, 33)]


def _torch_save(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    torch.save(tensor, stream)
    return stream.getvalue()


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _joined(cache: TemplateCache, tensor: torch.Tensor) -> bytes:
    saved = cache.saved(tensor)
    assert saved is not None
    joined = saved.head + bytes(saved.elements) + saved.tail
    assert saved.nbytes == len(joined)
    start, nbytes = saved.record
    assert joined[start : start + nbytes] == bytes(saved.elements)
    return joined


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_bytes_are_torch_saves_for_every_dtype_and_shape(dtype):
    cache = TemplateCache()
    with _without_zip_crc32():
        for shape in SHAPES:
            for seed in range(3):  # the first builds the template, the others reuse it
                tensor = _values(dtype, shape, seed)
                joined = _joined(cache, tensor)
                assert joined == _torch_save(tensor)
                loaded = torch.load(io.BytesIO(joined), weights_only=True)
                assert loaded.dtype == dtype and loaded.shape == tensor.shape
                assert torch.equal(_bytes(loaded), _bytes(tensor))
    assert len(cache) == len(SHAPES)


def _parameter() -> torch.Tensor:
    return torch.nn.Parameter(torch.ones(4), requires_grad=False)


def _with_attribute() -> torch.Tensor:
    tensor = torch.ones(4)
    tensor.tensor_model_parallel = True  # type: ignore[attr-defined]
    return tensor


@pytest.mark.parametrize(
    "make",
    [
        _parameter,
        _with_attribute,
        lambda: torch.ones(4, requires_grad=True),
        lambda: torch.ones(8)[2:6],  # a view: torch.save writes its whole storage
        lambda: torch.ones(4, 6).t(),
        lambda: torch.ones(4, dtype=torch.complex64).conj(),
        lambda: torch.ones(0),
    ],
    ids=["parameter", "attribute", "requires_grad", "view", "transposed", "conj", "empty"],
)
def test_other_tensors_are_left_to_torch_save(make):
    with _without_zip_crc32():
        assert TemplateCache().saved(make()) is None


def test_with_the_crcs_on_torch_save_runs():
    assert TemplateCache().saved(torch.ones(4)) is None  # the writer turns them off


def test_a_full_cache_still_answers():
    cache = TemplateCache(max_entries=1)
    with _without_zip_crc32():
        for n in (3, 4, 5):
            assert _joined(cache, torch.arange(n, dtype=torch.float32)) == _torch_save(
                torch.arange(n, dtype=torch.float32)
            )
    assert len(cache) == 1
