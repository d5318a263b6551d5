// Marks: single CUDA events recorded on a stream, read back later as raw
// readings (never waiting for the GPU), which Python turns into intervals
// (workbench/telemetry/gpu_timeline.py: pairing, queue order, clock mapping,
// late and failed marks).
//
// A reading is the GPU time from an "anchor" event to the mark, in float
// milliseconds (cudaEventElapsedTime), plus the anchor's host time (ns on
// the monotonic clock, time.monotonic_ns()): host_ns = anchor_ns + ms * 1e6.
// An anchor is recorded on a private idle stream and waited for, bracketed
// by host stamps; float milliseconds lose resolution with distance (24-bit
// mantissa: 60 ns at one second), so anchors are renewed every second and a
// mark keeps the anchor that was current when it was recorded.
//
// One process-wide store serves every device and every caller: the recording
// backend (through wb_mark's address, called from comm threads and CUDA
// future callbacks) and the Python probes (through ctypes).

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
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
  int64_t bracket_ns = 0;
  int device = 0;
  ~Anchor() {
    if (event != nullptr) {
      int previous = -1;
      cudaGetDevice(&previous);
      if (previous != device) {
        cudaSetDevice(device);
      }
      cudaEventDestroy(event);
      if (previous >= 0 && previous != device) {
        cudaSetDevice(previous);
      }
    }
  }
};

struct Mark {
  int device;
  cudaEvent_t event;
  std::shared_ptr<Anchor> anchor;
};

struct DeviceState {
  cudaStream_t anchor_stream = nullptr;
  std::shared_ptr<Anchor> anchor;
  std::vector<cudaEvent_t> spare; // reused: creating events costs microseconds
};

struct Store {
  std::mutex mu;
  std::unordered_map<int, DeviceState> devices;
  std::unordered_map<int64_t, Mark> marks;
  int64_t next_id = 1;
};

Store& store() {
  // Never destroyed: CUDA may already be torn down at process exit.
  static Store* s = new Store();
  return *s;
}

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

// Of three tries, keeps the anchor bracketed most tightly by host stamps,
// placed mid-way: its error is at most half the bracket (microseconds).
cudaError_t renew_anchor(DeviceState& d, int device) {
  if (d.anchor_stream == nullptr) {
    const cudaError_t err = cudaStreamCreateWithFlags(&d.anchor_stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      d.anchor_stream = nullptr;
      return err;
    }
  }
  std::shared_ptr<Anchor> best;
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto a = std::make_shared<Anchor>();
    a->device = device;
    cudaError_t err = cudaEventCreate(&a->event);
    if (err != cudaSuccess) {
      a->event = nullptr;
      return err;
    }
    const int64_t t0 = host_now_ns();
    err = cudaEventRecord(a->event, d.anchor_stream);
    if (err == cudaSuccess) {
      err = cudaEventSynchronize(a->event);
    }
    const int64_t t1 = host_now_ns();
    if (err != cudaSuccess) {
      return err;
    }
    if (!best || t1 - t0 < best->bracket_ns) {
      a->bracket_ns = t1 - t0;
      a->host_ns = t0 + (t1 - t0) / 2;
      best = std::move(a);
    }
  }
  d.anchor = std::move(best);
  return cudaSuccess;
}

cudaError_t take_event(DeviceState& d, cudaEvent_t* out) {
  if (!d.spare.empty()) {
    *out = d.spare.back();
    d.spare.pop_back();
    return cudaSuccess;
  }
  return cudaEventCreate(out);
}

} // namespace

extern "C" {

int64_t wb_mark(int device, uintptr_t stream) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  DeviceScope scope(device);
  if (scope.status != cudaSuccess) {
    return -static_cast<int64_t>(scope.status);
  }
  DeviceState& d = s.devices[device];
  if (!d.anchor || host_now_ns() - d.anchor->host_ns > kAnchorMaxAgeNs) {
    const cudaError_t err = renew_anchor(d, device);
    if (err != cudaSuccess) {
      return -static_cast<int64_t>(err);
    }
  }
  cudaEvent_t event = nullptr;
  cudaError_t err = take_event(d, &event);
  if (err == cudaSuccess) {
    err = cudaEventRecord(event, reinterpret_cast<cudaStream_t>(stream));
  }
  if (err != cudaSuccess) {
    if (event != nullptr) {
      d.spare.push_back(event);
    }
    return -static_cast<int64_t>(err);
  }
  const int64_t id = s.next_id++;
  s.marks.emplace(id, Mark{device, event, d.anchor});
  return id;
}

int wb_mark_again(int64_t id, uintptr_t stream) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.marks.find(id);
  if (it == s.marks.end()) {
    return cudaErrorInvalidValue;
  }
  DeviceScope scope(it->second.device);
  if (scope.status != cudaSuccess) {
    return scope.status;
  }
  // An event re-recorded stands for its latest record only: a "last
  // gradient produced" mark is moved forward hook after hook. Its anchor
  // stays: it was recorded before the first record, so before this one too.
  return cudaEventRecord(it->second.event, reinterpret_cast<cudaStream_t>(stream));
}

int wb_marks_read(const int64_t* ids, int n, wb_mark_reading* out, int release_done) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  for (int i = 0; i < n; ++i) {
    wb_mark_reading r{ids[i], WB_MARK_UNKNOWN, 0, 0, 0.0f};
    auto it = s.marks.find(ids[i]);
    if (it != s.marks.end()) {
      Mark& m = it->second;
      DeviceScope scope(m.device);
      cudaError_t err = scope.status;
      if (err == cudaSuccess) {
        // cudaEventQuery never blocks: a mark the GPU has not reached stays pending.
        err = cudaEventQuery(m.event);
      }
      if (err == cudaErrorNotReady) {
        r.state = WB_MARK_PENDING;
      } else {
        float ms = 0.0f;
        if (err == cudaSuccess) {
          err = cudaEventElapsedTime(&ms, m.anchor->event, m.event);
        }
        if (err == cudaSuccess) {
          r.state = WB_MARK_DONE;
          r.anchor_ns = m.anchor->host_ns;
          r.elapsed_ms = ms;
        } else {
          r.state = WB_MARK_ERROR;
          r.error = static_cast<int32_t>(err);
        }
        if (release_done) {
          s.devices[m.device].spare.push_back(m.event);
          s.marks.erase(it);
        }
      }
    }
    out[i] = r;
  }
  return cudaSuccess;
}

int wb_marks_release(const int64_t* ids, int n) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  for (int i = 0; i < n; ++i) {
    auto it = s.marks.find(ids[i]);
    if (it != s.marks.end()) {
      // Pooled, not destroyed: re-recording a spare event later is legal even
      // if the GPU has not reached its old record yet.
      s.devices[it->second.device].spare.push_back(it->second.event);
      s.marks.erase(it);
    }
  }
  return cudaSuccess;
}

int wb_marks_live(void) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<int>(s.marks.size());
}

} // extern "C"
