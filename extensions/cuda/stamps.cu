// Timing spans of GPU work with CUDA events, reported on the host clock.
//
// CUDA events give GPU times relative to each other; to place them on the
// host's monotonic clock each span is measured from an "anchor" event whose
// host time is known (recorded on an idle private stream and waited for).
// cudaEventElapsedTime returns float milliseconds, whose resolution decays
// with distance (float has 24 bits), so anchors are renewed every second
// and each span keeps the anchor that was current when it began.

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "wb_cuda.h"

namespace {

int64_t host_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr int64_t kAnchorMaxAgeNs = 1'000'000'000;

struct Anchor {
  cudaEvent_t event = nullptr;
  int64_t host_ns = 0;
  ~Anchor() {
    if (event != nullptr) {
      cudaEventDestroy(event);
    }
  }
};

struct Span {
  int64_t id;
  std::shared_ptr<Anchor> anchor;
  cudaEvent_t start;
  cudaEvent_t end = nullptr; // null until wb_stamper_end
};

} // namespace

struct wb_stamper {
  int device = 0;
  cudaStream_t anchor_stream = nullptr;
  std::mutex mu;
  std::shared_ptr<Anchor> anchor;
  std::deque<Span> spans;
  std::vector<cudaEvent_t> spare; // reused: creating events costs microseconds
  int64_t next_id = 1;
};

namespace {

// Sets the device for the calling thread and puts the old one back.
struct DeviceScope {
  int previous = -1;
  cudaError_t status;
  explicit DeviceScope(int device) {
    status = cudaGetDevice(&previous);
    if (status == cudaSuccess && previous != device) {
      status = cudaSetDevice(device);
    }
  }
  ~DeviceScope() {
    if (previous >= 0) {
      cudaSetDevice(previous);
    }
  }
};

cudaError_t take_event(wb_stamper* s, cudaEvent_t* out) {
  if (!s->spare.empty()) {
    *out = s->spare.back();
    s->spare.pop_back();
    return cudaSuccess;
  }
  return cudaEventCreate(out);
}

// Records an anchor on the private stream and waits for it. Of three tries
// it keeps the one bracketed most tightly by host stamps, placed mid-way
// between them: the error is at most half that bracket (microseconds).
cudaError_t renew_anchor(wb_stamper* s) {
  std::shared_ptr<Anchor> best;
  int64_t best_width = INT64_MAX;
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto a = std::make_shared<Anchor>();
    cudaError_t err = cudaEventCreate(&a->event);
    if (err != cudaSuccess) {
      return err;
    }
    const int64_t t0 = host_now_ns();
    err = cudaEventRecord(a->event, s->anchor_stream);
    if (err == cudaSuccess) {
      err = cudaEventSynchronize(a->event);
    }
    const int64_t t1 = host_now_ns();
    if (err != cudaSuccess) {
      return err;
    }
    if (t1 - t0 < best_width) {
      best_width = t1 - t0;
      a->host_ns = t0 + (t1 - t0) / 2;
      best = std::move(a);
    }
  }
  s->anchor = std::move(best);
  return cudaSuccess;
}

int64_t to_host_ns(const Anchor& a, cudaEvent_t e, cudaError_t* err) {
  float ms = 0.0f;
  *err = cudaEventElapsedTime(&ms, a.event, e);
  return a.host_ns + static_cast<int64_t>(static_cast<double>(ms) * 1e6);
}

} // namespace

extern "C" {

int wb_stamper_create(int device, wb_stamper** out) {
  *out = nullptr;
  DeviceScope scope(device);
  if (scope.status != cudaSuccess) {
    return scope.status;
  }
  auto s = std::make_unique<wb_stamper>();
  s->device = device;
  cudaError_t err = cudaStreamCreateWithFlags(&s->anchor_stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    err = renew_anchor(s.get());
  }
  if (err != cudaSuccess) {
    if (s->anchor_stream != nullptr) {
      cudaStreamDestroy(s->anchor_stream);
    }
    return err;
  }
  *out = s.release();
  return cudaSuccess;
}

void wb_stamper_destroy(wb_stamper* s) {
  if (s == nullptr) {
    return;
  }
  {
    DeviceScope scope(s->device);
    for (auto& span : s->spans) {
      cudaEventDestroy(span.start);
      if (span.end != nullptr) {
        cudaEventDestroy(span.end);
      }
    }
    for (auto e : s->spare) {
      cudaEventDestroy(e);
    }
    s->anchor.reset();
    cudaStreamDestroy(s->anchor_stream);
  }
  delete s;
}

int wb_stamper_begin(wb_stamper* s, uintptr_t stream, int64_t* id) {
  std::lock_guard<std::mutex> lock(s->mu);
  DeviceScope scope(s->device);
  if (scope.status != cudaSuccess) {
    return scope.status;
  }
  if (host_now_ns() - s->anchor->host_ns > kAnchorMaxAgeNs) {
    const cudaError_t err = renew_anchor(s);
    if (err != cudaSuccess) {
      return err;
    }
  }
  Span span{s->next_id, s->anchor, nullptr};
  cudaError_t err = take_event(s, &span.start);
  if (err == cudaSuccess) {
    err = cudaEventRecord(span.start, reinterpret_cast<cudaStream_t>(stream));
  }
  if (err != cudaSuccess) {
    if (span.start != nullptr) {
      s->spare.push_back(span.start);
    }
    return err;
  }
  *id = s->next_id++;
  s->spans.push_back(std::move(span));
  return cudaSuccess;
}

int wb_stamper_end(wb_stamper* s, int64_t id, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(s->mu);
  DeviceScope scope(s->device);
  if (scope.status != cudaSuccess) {
    return scope.status;
  }
  for (auto& span : s->spans) {
    if (span.id != id) {
      continue;
    }
    if (span.end != nullptr) {
      return cudaErrorInvalidValue; // ended twice
    }
    cudaError_t err = take_event(s, &span.end);
    if (err == cudaSuccess) {
      err = cudaEventRecord(span.end, reinterpret_cast<cudaStream_t>(stream));
    }
    return err;
  }
  return cudaErrorInvalidValue; // unknown id
}

int wb_stamper_drain(wb_stamper* s, wb_span* out, int capacity, int* written) {
  std::lock_guard<std::mutex> lock(s->mu);
  *written = 0;
  DeviceScope scope(s->device);
  if (scope.status != cudaSuccess) {
    return scope.status;
  }
  cudaError_t first_error = cudaSuccess;
  for (auto it = s->spans.begin(); it != s->spans.end() && *written < capacity;) {
    // cudaEventQuery never blocks: a span whose end has not happened on the
    // GPU yet is simply left for the next drain.
    if (it->end == nullptr || cudaEventQuery(it->end) != cudaSuccess) {
      ++it;
      continue;
    }
    cudaError_t e1, e2;
    wb_span r{it->id, to_host_ns(*it->anchor, it->start, &e1), to_host_ns(*it->anchor, it->end, &e2)};
    if (e1 == cudaSuccess && e2 == cudaSuccess) {
      out[(*written)++] = r;
    } else if (first_error == cudaSuccess) {
      first_error = e1 != cudaSuccess ? e1 : e2;
    }
    s->spare.push_back(it->start);
    s->spare.push_back(it->end);
    it = s->spans.erase(it);
  }
  return first_error;
}

int wb_stamper_pending(wb_stamper* s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return static_cast<int>(s->spans.size());
}

} // extern "C"
