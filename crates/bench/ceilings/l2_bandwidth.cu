// The ceilings of a GPU for the performance notes (CUDA events, median of 12 runs): the read
// bandwidth of buffers that fit L2 (8 to 48 MB, each read 40 times per run) and of one that
// does not (2 GB: HBM), and the time of an empty kernel timed with events around one launch
// (the launch latency inside every single-launch time of spattn-bench).
//
//   nvcc -arch=sm_90 -O3 -o l2bw crates/bench/ceilings/l2_bandwidth.cu && ./l2bw
//
// The H200's ceilings: docs/kernels/README.md, "Where the measurements come from".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                       \
    do {                                                                                  \
        cudaError_t e_ = (call);                                                          \
        if (e_ != cudaSuccess) {                                                          \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            std::exit(1);                                                                 \
        }                                                                                 \
    } while (0)

// Reads n16 16-byte words `iters` times (through L2 only: ld.global.cg) and folds them so the
// loads cannot be removed.
__global__ void read_words(const uint4* __restrict__ p, size_t n16, int iters, uint4* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (int it = 0; it < iters; ++it)
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += stride) {
            const uint4 x = __ldcg(p + i);
            acc.x ^= x.x;
            acc.y ^= x.y;
            acc.z ^= x.z;
            acc.w ^= x.w;
        }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[0] = acc;
}

__global__ void empty_kernel() {}

static float median(std::vector<float> t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// `reps` times: events around what `launch` enqueues; the times in ms.
template <class F> static std::vector<float> time_runs(int reps, F launch) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(a));
        launch();
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return t;
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    uint4* sink;
    CHECK(cudaMalloc(&sink, 64));
    for (size_t mb : {8, 16, 32, 48, 2048}) {
        const size_t bytes = mb << 20, n16 = bytes / 16;
        uint4* p;
        CHECK(cudaMalloc(&p, bytes));
        CHECK(cudaMemset(p, 1, bytes));
        const int iters = mb >= 1024 ? 2 : 40;
        const float ms = median(time_runs(12, [&] {
            read_words<<<prop.multiProcessorCount * 8, 256>>>(p, n16, iters, sink);
        }));
        std::printf("read %5zu MB x%d: %.4f ms -> %.2f TB/s\n", mb, iters, ms,
                    bytes * (double)iters / (ms * 1e-3) / 1e12);
        CHECK(cudaFree(p));
    }
    const std::vector<float> t =
        time_runs(50, [&] { empty_kernel<<<prop.multiProcessorCount, 128>>>(); });
    std::printf("empty kernel, events around one launch: median %.4f ms, min %.4f ms\n",
                median(t), *std::min_element(t.begin(), t.end()));
    CHECK(cudaFree(sink));
    return 0;
}
