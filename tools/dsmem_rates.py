"""How fast a CTA moves 32 KiB of fp32 to or from its peer in a cluster of two, every SM busy: the
question behind a dQ pair sum in distributed shared memory (docs/perf.md v56).

Rows (cycles for one warp to move one 32 KiB part, median over the CTAs, 1 and 2 such warps per
CTA at once):
- remote reds: each lane reads 16 bytes of its own part and adds them into the peer's part with four
  `red.shared::cluster.add.f32` (how a non-adding CTA would push its dQ part into the adder's);
- remote loads: each lane keeps 8 `ld.shared::cluster.v4.f32` in flight and adds them into a local
  buffer (how an adder would pull the peer's part);
- local loads: the same loop reading this CTA's own part (shared memory's rate, for scale).

Usage: `.venv/bin/python tools/dsmem_rates.py build build/dsmem.cubin` here (NVRTC), then
`python3 tools/dsmem_rates.py run build/dsmem.cubin` on a GPU machine (cuda-bindings).
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

PART_FLOATS = 8192  # 32 KiB
REPS = 20
THREADS = 384  # the hopper backward's CTA: a producer warpgroup, two consumer warpgroups
SMEM_BYTES = 200 * 1024  # one CTA per SM, as the d 256 backward runs

SOURCE = r"""
typedef unsigned int uint32_t;
constexpr int kPart = %(part)d;

__device__ __forceinline__ float4 load_v4(uint32_t address, bool remote) {
  float4 v;
  if (remote) {
    asm volatile("ld.shared::cluster.v4.f32 {%%0, %%1, %%2, %%3}, [%%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(address));
  } else {
    asm volatile("ld.shared.v4.f32 {%%0, %%1, %%2, %%3}, [%%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(address));
  }
  return v;
}

// mode 0: remote reds; 1: remote loads; 2: local loads. out[block * 12 + warp]: the warp's cycles.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(%(threads)d, 1)
dsmem_rates(int mode, int warps, int reps, unsigned long long* out) {
  extern __shared__ __align__(16) float buffer[];  // a part per moving warp, then a sum buffer
  const int warp = threadIdx.x / 32, lane = threadIdx.x %% 32;
  uint32_t rank;
  asm volatile("mov.u32 %%0, %%cluster_ctarank;" : "=r"(rank));
  for (int i = threadIdx.x; i < 3 * kPart; i += blockDim.x) {
    buffer[i] = 1.f;
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (warp >= 1 && warp <= warps) {
    float* const part = buffer + (warp - 1) * kPart;
    float* const sum = buffer + 2 * kPart;
    const uint32_t local = (uint32_t)__cvta_generic_to_shared(part);
    uint32_t peer;
    asm volatile("mapa.shared::cluster.u32 %%0, %%1, %%2;" : "=r"(peer) : "r"(local), "r"(rank ^ 1));
    const unsigned long long start = clock64();
    for (int r = 0; r < reps; ++r) {
      if (mode == 0) {
#pragma unroll 4
        for (int j = lane * 4; j < kPart; j += 128) {
          const float4 v = *reinterpret_cast<float4*>(part + j);
          const uint32_t a = peer + j * 4;
          asm volatile("red.shared::cluster.add.f32 [%%0], %%1;" ::"r"(a), "f"(v.x) : "memory");
          asm volatile("red.shared::cluster.add.f32 [%%0], %%1;" ::"r"(a + 4), "f"(v.y) : "memory");
          asm volatile("red.shared::cluster.add.f32 [%%0], %%1;" ::"r"(a + 8), "f"(v.z) : "memory");
          asm volatile("red.shared::cluster.add.f32 [%%0], %%1;" ::"r"(a + 12), "f"(v.w) : "memory");
        }
        asm volatile("fence.acq_rel.cluster;" ::: "memory");
      } else {
        const uint32_t source = mode == 1 ? peer : local;
        for (int j0 = lane * 4; j0 < kPart; j0 += 128 * 8) {
          float4 v[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            v[u] = load_v4(source + (j0 + u * 128) * 4, mode == 1);
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            float4* const s = reinterpret_cast<float4*>(sum + j0 + u * 128);
            float4 o = *s;
            o.x += v[u].x; o.y += v[u].y; o.z += v[u].z; o.w += v[u].w;
            *s = o;
          }
        }
      }
    }
    const unsigned long long cycles = clock64() - start;
    if (lane == 0) {
      out[blockIdx.x * 12 + warp] = cycles;
    }
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
"""

MODES = ("remote reds (red.shared::cluster.add.f32)", "remote loads (ld.shared::cluster.v4, 8 in flight)",
         "local loads (ld.shared.v4, 8 in flight)")


def build(cubin: Path) -> None:
    from flashkiln.generator import nvrtc

    source = SOURCE % {"part": PART_FLOATS, "threads": THREADS}
    cubin.parent.mkdir(parents=True, exist_ok=True)
    cubin.write_bytes(nvrtc.compile_cubin(source, "dsmem_rates", ["-arch=sm_90a", "-std=c++17"]).cubin)


def run(cubin: Path) -> None:
    import statistics

    from cuda.bindings import driver as cu

    def ok(result: tuple):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {result[0]}")
        return result[1] if len(result) == 2 else None

    ok(cu.cuInit(0))
    device = ok(cu.cuDeviceGet(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(device))))
    sms = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device))
    name = ok(cu.cuDeviceGetName(64, device)).split(b"\0")[0].decode()
    kernel = ok(cu.cuModuleGetFunction(ok(cu.cuModuleLoadData(cubin.read_bytes())), b"dsmem_rates"))
    ok(cu.cuFuncSetAttribute(kernel, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             SMEM_BYTES))
    grid = sms - sms % 2
    out = ok(cu.cuMemAlloc(grid * 12 * 8))
    print(f"{name}, {grid} CTAs in clusters of 2, {REPS} passes; cycles per 32 KiB part and warp (median over CTAs)")
    for mode, label in enumerate(MODES):
        for warps in (1, 2):
            args = (ctypes.c_int(mode), ctypes.c_int(warps), ctypes.c_int(REPS), ctypes.c_uint64(int(out)))
            pointers = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args))
            for _ in range(2):  # the first launch warms up
                ok(cu.cuMemsetD8(out, 0, grid * 12 * 8))
                ok(cu.cuLaunchKernel(kernel, grid, 1, 1, THREADS, 1, 1, SMEM_BYTES, 0, ctypes.addressof(pointers), 0))
                ok(cu.cuCtxSynchronize())
            cycles = (ctypes.c_uint64 * (grid * 12))()
            ok(cu.cuMemcpyDtoH(ctypes.addressof(cycles), out, ctypes.sizeof(cycles)))
            per_part = statistics.median(cycles[b * 12 + w] / REPS for b in range(grid) for w in range(1, warps + 1))
            print(f"{label}, {warps} warp(s) per CTA: {per_part:.0f} cycles, "
                  f"{warps * PART_FLOATS * 4 / per_part:.1f} bytes per cycle and SM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("build", "run"))
    parser.add_argument("cubin", type=Path)
    args = parser.parse_args()
    (build if args.step == "build" else run)(args.cubin)


if __name__ == "__main__":
    main()
