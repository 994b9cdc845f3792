// Binds torch's compute threads to cores, one each: what vLLM's CPU worker does at start-up.
//
// Why: unbound, Linux may wake an OpenMP worker on the core its waker runs on, or move it
// behind another process's thread, and every parallel region then waits at its barrier for the
// slowest thread; bound, each thread keeps its core (and its cache). The threads are OpenMP's
// pool, which torch's parallel regions reuse for as long as the thread count stays the same, so
// one parallel region of that many threads binds them all.

#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__linux__) && defined(_OPENMP)
#include <omp.h>
#include <sched.h>
#define KVGRAPH_BIND_THREADS 1
#endif

namespace {

// Thread i of a parallel region of cpus.size() threads goes to cpus[i]; returns the core each
// thread runs on afterwards (sched_getcpu), or an empty list where binding is not built
// (not Linux, or no OpenMP).
std::vector<int64_t> bind_compute_threads(std::vector<int64_t> cpus) {
  std::vector<int64_t> placed;
#ifdef KVGRAPH_BIND_THREADS
  const int threads = static_cast<int>(cpus.size());
  TORCH_CHECK(threads > 0, "bind_compute_threads: expected at least one CPU");
  std::vector<int> failed(threads, 0);
  placed.assign(threads, -1);
#pragma omp parallel num_threads(threads)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    failed[i] = sched_setaffinity(0, sizeof(set), &set) != 0;  // 0: the calling thread
    placed[i] = sched_getcpu();
  }
  for (int i = 0; i < threads; ++i)
    TORCH_CHECK(!failed[i], "bind_compute_threads: could not bind thread ", i, " to CPU ",
                cpus[i], " (not in this process's affinity mask?)");
#endif
  return placed;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgraph_cpu, m) {
  m.def("bind_compute_threads(int[] cpus) -> int[]");
}

TORCH_LIBRARY_IMPL(kvgraph_cpu, CompositeExplicitAutograd, m) {
  m.impl("bind_compute_threads", &bind_compute_threads);
}
