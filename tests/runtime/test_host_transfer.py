"""runtime.host_transfer: parameters to one flat fp32 CPU vector and back, through two pinned
chunks on CUDA (those cases run where CUDA is: scripts/gpu-check.sh runs this file there) and
directly on the CPU."""

import pytest
import torch

from nebula_cli.runtime.host_transfer import HostStage
from nebula_cli.runtime.params import _DirectIO

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_parts_are_concatenated_as_fp32():
    parts = [torch.arange(5, dtype=torch.float64), torch.ones(2, 3, dtype=torch.bfloat16)]
    out = HostStage(chunk=4).gather(parts, 11)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.cat([parts[0].float(), parts[1].float().reshape(-1)]))


def test_a_wrong_element_count_is_an_error():
    with pytest.raises(ValueError, match="hold 5 elements, not 6"):
        HostStage().gather([torch.zeros(5)], 6)


def test_upload_to_the_cpu_is_the_value_itself():
    value = torch.randn(3, 4)
    assert HostStage().upload(value, torch.device("cpu")) is value


def test_param_io_round_trip_on_the_cpu_makes_no_pinned_buffer():
    ps = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
    io = _DirectIO(ps)
    io.write(io.read() + 1.0)
    assert torch.equal(io.read(), torch.cat([p.detach() for p in ps]))
    assert io.stage._buffers == []


@CUDA
def test_cuda_parts_cross_chunk_boundaries_exactly():
    parts = [torch.randn(n, device="cuda") for n in (1, 7, 13, 64)]
    parts.append(torch.randn(9, device="cuda", dtype=torch.bfloat16))
    parts.insert(2, torch.randn(5))  # a CPU part among them
    numel = sum(p.numel() for p in parts)
    out = HostStage(chunk=8).gather(parts, numel)
    assert not out.is_cuda
    assert torch.equal(out, torch.cat([p.detach().float().cpu().reshape(-1) for p in parts]))


@CUDA
def test_cuda_upload_in_chunks_keeps_shape_and_values():
    value = torch.randn(37, 3)
    got = HostStage(chunk=16).upload(value, torch.device("cuda"))
    assert got.is_cuda and got.shape == value.shape
    assert torch.equal(got.cpu(), value)


@CUDA
def test_param_io_round_trip_on_cuda():
    ps = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (3, 100, 1 << 20)]
    io = _DirectIO(ps)
    io.stage = HostStage(chunk=1000)  # many chunks, both buffers reused
    flat = io.read()
    assert torch.equal(flat, torch.cat([p.detach().cpu() for p in ps]))
    io.write(flat * 2)
    assert torch.equal(torch.cat([p.detach().cpu() for p in ps]), flat * 2)
