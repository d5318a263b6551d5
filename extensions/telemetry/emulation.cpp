#include "emulation.h"

#include <ATen/core/ivalue.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "clock.h"
#include "emulation_bindings.h"

namespace wbt {

namespace {

// --- the model: per group, the lines of each kind (workbench/links.py) ----------

struct Line {
  double latency_s = 0;
  double seconds_per_byte = 0;
};

struct Lines {
  std::vector<Line> lines;
  double seconds(int64_t bytes) const {
    double best = std::numeric_limits<double>::infinity();
    for (const auto& l : lines) {
      best = std::min(best, l.latency_s + static_cast<double>(bytes) * l.seconds_per_byte);
    }
    return lines.empty() ? 0.0 : best;
  }
};

// When each rank of a group issued its collectives, in memory every rank of
// the group maps (ranks on one host share CLOCK_MONOTONIC): after a
// collective ends for real, a rank reads when its last peer arrived instead
// of estimating it. Slots are tagged with the sequence number + 1 they hold,
// so a slot still holding an older collective is never read as this one.
//   collectives: [kSlots][n] of {tag, ns}: rank j's k-th collective of the group;
//   p2p:         [n][n][kP2pSlots] of {send tag, send ns, recv tag, recv ns}: the k-th transfer src -> dst.
class Arrivals {
 public:
  static constexpr int64_t kSlots = 256;
  static constexpr int64_t kP2pSlots = 64;

  static size_t bytes_for(int n) {
    return sizeof(int64_t) * (kSlots * n * 2 + static_cast<size_t>(n) * n * kP2pSlots * 4);
  }

  Arrivals(const std::string& path, size_t offset, int n, int me) : n_(n), me_(me), size_(bytes_for(n)) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
    TORCH_CHECK(fd >= 0, "workbench emulation: cannot open ", path);
    struct stat st {};
    const size_t end = offset + size_;
    if (::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) < end) {
      TORCH_CHECK(::ftruncate(fd, static_cast<off_t>(end)) == 0, "workbench emulation: cannot size ", path);
    }
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    TORCH_CHECK(offset % page == 0, "workbench emulation: arrivals offset not page-aligned");
    void* map = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(offset));
    ::close(fd);
    TORCH_CHECK(map != MAP_FAILED, "workbench emulation: cannot map ", path);
    base_ = static_cast<std::atomic<int64_t>*>(map);
  }
  ~Arrivals() {
    ::munmap(base_, size_);
  }
  Arrivals(const Arrivals&) = delete;
  Arrivals& operator=(const Arrivals&) = delete;

  // This rank issues its `seq`-th collective of the group at `ns`.
  void arrive(int64_t seq, int64_t ns) {
    stamp(coll(seq, me_), seq, ns);
  }
  // The latest issue of the `seq`-th collective over the ranks that have stamped it.
  int64_t last(int64_t seq, int64_t own_ns) const {
    int64_t latest = own_ns;
    for (int j = 0; j < n_; ++j) {
      latest = std::max(latest, read(coll(seq, j), seq, own_ns));
    }
    return latest;
  }
  // The k-th transfer from src to dst: a send stamps its side, a recv the other.
  void arrive_p2p(int src, int dst, int64_t k, bool sending, int64_t ns) {
    stamp(p2p(src, dst, k) + (sending ? 0 : 2), k, ns);
  }
  int64_t last_p2p(int src, int dst, int64_t k, int64_t own_ns) const {
    const auto* e = p2p(src, dst, k);
    return std::max({own_ns, read(e, k, own_ns), read(e + 2, k, own_ns)});
  }

 private:
  std::atomic<int64_t>* coll(int64_t seq, int rank) const {
    return base_ + ((seq % kSlots) * n_ + rank) * 2;
  }
  std::atomic<int64_t>* p2p(int src, int dst, int64_t k) const {
    return base_ + kSlots * n_ * 2 + ((static_cast<int64_t>(src) * n_ + dst) * kP2pSlots + k % kP2pSlots) * 4;
  }
  static void stamp(std::atomic<int64_t>* slot, int64_t seq, int64_t ns) {
    slot[1].store(ns, std::memory_order_relaxed);
    slot[0].store(seq + 1, std::memory_order_release); // the tag last: a reader never sees a stale time
  }
  static int64_t read(const std::atomic<int64_t>* slot, int64_t seq, int64_t otherwise) {
    return slot[0].load(std::memory_order_acquire) == seq + 1 ? slot[1].load(std::memory_order_relaxed) : otherwise;
  }

  int n_, me_;
  size_t size_;
  std::atomic<int64_t>* base_ = nullptr;
};

static_assert(std::atomic<int64_t>::is_always_lock_free, "arrivals are shared between processes");

// How many collectives (and transfers to/from each peer) this rank issued on
// a group while it was emulated: the index every rank of the group agrees on.
struct Counters {
  explicit Counters(int n) : sent(n), received(n) {}
  std::atomic<int64_t> collectives{0};
  std::vector<std::atomic<int64_t>> sent, received;
};

struct GroupModel {
  std::unordered_map<std::string, Lines> target; // by kind; "p2p" prices a coalesced send/recv batch
  std::vector<Lines> peers;                      // send/recv by the peer's group rank
  std::unordered_map<std::string, Lines> real;   // this machine's own transfer time, by kind
  int me = 0;                                    // this rank's place in the group
  std::shared_ptr<Arrivals> arrivals;            // null: peers' arrivals estimated from `real`
  std::shared_ptr<Counters> counters;
};

// Counters outlive a repricing of their group (calibrate, install): ranks keep agreeing on the index.
std::unordered_map<std::string, std::shared_ptr<Counters>> g_counters;

std::mutex g_mu;
std::unordered_map<std::string, std::shared_ptr<const GroupModel>> g_groups;
std::atomic<bool> g_on{false};
std::atomic<double> g_dilation{0.0};
std::atomic<uint64_t> g_paced{0};
std::atomic<uint64_t> g_overruns{0};

void refresh_on_locked() {
  g_on.store(!g_groups.empty() && g_dilation.load() > 0.0);
}

std::shared_ptr<const GroupModel> group(const std::string& uid) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_groups.find(uid);
  return it == g_groups.end() ? nullptr : it->second;
}

// When a collective started: when its last peer arrived. Read from the
// arrivals where the group shares them; else no earlier than this rank's
// issue and no later than the real end less this machine's own transfer time.
struct Start {
  int64_t own_ns = 0;
  int64_t real_ns = 0;
  std::shared_ptr<Arrivals> arrivals;
  int kind = 0; // 0: collective, 1: send, 2: recv
  int64_t index = 0;
  int src = 0, dst = 0;

  int64_t at(int64_t real_end_ns) const {
    if (!arrivals) {
      return std::max(own_ns, real_end_ns - real_ns);
    }
    return kind == 0 ? arrivals->last(index, own_ns) : arrivals->last_p2p(src, dst, index, own_ns);
  }
};

// When the collective may report completion: its start plus the dilated target time.
int64_t deadline_ns(const Start& start, int64_t real_end_ns, int64_t target_ns) {
  const int64_t deadline = start.at(real_end_ns) + target_ns;
  if (deadline <= real_end_ns) {
    ++g_overruns; // this machine was slower than the emulated cluster: the real time stands
  }
  return deadline;
}

// --- the timer: one sleeping thread completes CPU futures at their deadlines ----

class Pacer {
 public:
  // Runs `fn` on the timer thread at or after `deadline` (monotonic ns).
  void at(int64_t deadline, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!started_) {
        // Detached: it lives as long as the process, like the rank's recorder.
        std::thread([this] { loop(); }).detach();
        started_ = true;
      }
      due_.emplace(deadline, std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const auto first = due_.begin();
      if (now_ns() < first->first) {
        cv_.wait_until(lock, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(first->first)));
        continue;
      }
      auto fn = std::move(first->second);
      due_.erase(first);
      lock.unlock();
      fn(); // completes a future: its callbacks (the recorder's stamp, DDP's) run here
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<int64_t, std::function<void()>> due_;
  bool started_ = false;
};

Pacer& pacer() {
  static Pacer* p = new Pacer(); // never destroyed: its thread may outlive static destruction
  return *p;
}

// --- paced Works: the inner backend's Work, completing later ------------------

// What both paced Works forward unchanged to the inner backend's Work.
class PacedBase : public c10d::Work {
 public:
  explicit PacedBase(c10::intrusive_ptr<c10d::Work> inner)
      : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)) {}

  bool isSuccess() const override {
    return inner_->isSuccess();
  }
  std::exception_ptr exception() const override {
    return inner_->exception();
  }
  int sourceRank() const override {
    return inner_->sourceRank();
  }
  std::vector<at::Tensor> result() override {
    return inner_->result();
  }
  void abort() override {
    inner_->abort();
  }
  float getDuration() const override {
    return inner_->getDuration();
  }
  uint64_t getSequencenumber() const override {
    return inner_->getSequencenumber();
  }
 protected:
  c10::intrusive_ptr<c10d::Work> inner_;
};

// --- CPU: a Work whose completion waits for the deadline ----------------------

class PacedWork final : public PacedBase {
 public:
  PacedWork(c10::intrusive_ptr<c10d::Work> inner, Start start, int64_t target_ns)
      : PacedBase(std::move(inner)),
        start_(std::move(start)),
        target_ns_(target_ns) {
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    try {
      fut = inner_->getFuture();
    } catch (const c10::Error&) {
      // gloo's send/recv and reduce_scatter finish inside wait(): paced there.
    }
    if (!fut) {
      return;
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(fut->elementType());
    // Captures no Work (a future owning its Work back would never be freed).
    fut->addCallback([out = future_, start = start_, target_ns](c10::ivalue::Future& f) {
      if (f.hasError()) {
        out->setError(f.exception_ptr());
        return;
      }
      const int64_t end = now_ns();
      const int64_t due = deadline_ns(start, end, target_ns);
      if (due <= end) {
        out->markCompleted(f.value());
        return;
      }
      pacer().at(due, [out, value = f.value()]() mutable { out->markCompleted(std::move(value)); });
    });
  }

  bool isCompleted() override {
    if (future_) {
      return future_->completed();
    }
    return inner_->isCompleted() && now_ns() >= resolve_deadline();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    if (future_) {
      future_->wait(); // a condition variable: sleeps until the timer completes it
      future_->value(); // rethrows a failure
    } else {
      std::this_thread::sleep_until(
          std::chrono::steady_clock::time_point(std::chrono::nanoseconds(resolve_deadline())));
    }
    return ok;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_ ? future_ : inner_->getFuture();
  }
  void synchronize() override {
    inner_->synchronize();
  }

 private:
  // A Work without a future learns of its real end when it is first found
  // complete: the deadline counts from then.
  int64_t resolve_deadline() {
    int64_t due = deadline_.load();
    if (due == 0) {
      const int64_t fresh = deadline_ns(start_, now_ns(), target_ns_);
      if (deadline_.compare_exchange_strong(due, fresh)) {
        due = fresh;
      }
    }
    return due;
  }

  c10::intrusive_ptr<c10::ivalue::Future> future_;
  Start start_;
  int64_t target_ns_;
  std::atomic<int64_t> deadline_{0};
};

// --- CUDA: the consumer's stream is held by a kernel waiting on the GPU clock ---

// wb_emulate_stamp / wb_emulate_hold of the nvcc-built library (extensions/cuda/wb_emulate.h),
// supplied by address so this extension links no CUDA.
using CudaStamp = int64_t (*)(int device, uintptr_t stream);
using CudaHold = int (*)(int device, uintptr_t stream, int64_t slot, int64_t target_ns, int64_t real_ns);
std::atomic<CudaStamp> g_cuda_stamp{nullptr};
std::atomic<CudaHold> g_cuda_hold{nullptr};

uintptr_t stream_of(const at::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return reinterpret_cast<uintptr_t>(impl.getStream(device).native_handle());
}

void hold_current_stream(const at::Device& device, int64_t slot, int64_t target_ns, int64_t real_ns) {
  const CudaHold hold = g_cuda_hold.load();
  const int err = hold(device.index(), stream_of(device), slot, target_ns, real_ns);
  TORCH_CHECK(err == 0, "workbench emulation: holding the stream failed (CUDA error ", err, ")");
}

// NCCL's Work: wait() makes the caller's stream wait for the collective; ours
// then also makes it wait for the deadline. The future handed out completes
// after a hold recorded on the callback's stream, which CUDA futures make
// their consumers wait for. isCompleted() reports the real completion only:
// the deadline lives on the GPU clock.
class PacedCudaWork final : public PacedBase {
 public:
  PacedCudaWork(
      c10::intrusive_ptr<c10d::Work> inner,
      at::Device device,
      int64_t slot,
      int64_t real_ns,
      int64_t target_ns)
      : PacedBase(std::move(inner)),
        device_(device),
        slot_(slot),
        real_ns_(real_ns),
        target_ns_(target_ns) {}

  bool isCompleted() override {
    return inner_->isCompleted();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    hold_current_stream(device_, slot_, target_ns_, real_ns_);
    return ok;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!future_) {
      auto fut = inner_->getFuture();
      future_ = fut->then(
          [device = device_, slot = slot_, target = target_ns_, real = real_ns_](c10::ivalue::Future& f) {
            if (!f.hasError()) {
              hold_current_stream(device, slot, target, real);
            }
            return f.value();
          },
          fut->elementType());
    }
    return future_;
  }
  void synchronize() override {
    inner_->synchronize();
    hold_current_stream(device_, slot_, target_ns_, real_ns_);
  }
  void blockCurrentStream() override {
    inner_->blockCurrentStream();
    hold_current_stream(device_, slot_, target_ns_, real_ns_);
  }

 private:
  at::Device device_;
  int64_t slot_, real_ns_, target_ns_;
  std::mutex mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// --- what a collective costs --------------------------------------------------

struct Cost {
  bool paced = false;
  int64_t target_ns = 0; // dilated
  int64_t real_ns = 0;
  std::shared_ptr<const GroupModel> model;
  int kind = 0; // Start::kind
  int peer = -1;
};

// Stamps this rank's arrival (where the group shares arrivals) and returns the start to resolve later.
Start arrive(const Cost& c, int64_t now) {
  Start s;
  s.own_ns = now;
  s.real_ns = c.real_ns;
  const auto& m = *c.model;
  if (!m.arrivals) {
    return s;
  }
  s.arrivals = m.arrivals;
  s.kind = c.kind;
  if (c.kind == 0) {
    s.index = m.counters->collectives++;
    m.arrivals->arrive(s.index, now);
  } else {
    const bool sending = c.kind == 1;
    s.src = sending ? m.me : c.peer;
    s.dst = sending ? c.peer : m.me;
    s.index = (sending ? m.counters->sent[c.peer] : m.counters->received[c.peer])++;
    m.arrivals->arrive_p2p(s.src, s.dst, s.index, sending, now);
  }
  return s;
}

bool is_p2p(const std::string& op) {
  return op == "send" || op == "recv";
}

Cost cost_of(const std::string& uid, const std::string& op, int64_t bytes, int peer) {
  Cost c;
  const auto model = group(uid);
  if (!model) {
    return c;
  }
  const Lines* lines = nullptr;
  if (is_p2p(op) && peer >= 0) {
    if (static_cast<size_t>(peer) < model->peers.size()) {
      lines = &model->peers[peer];
    }
  } else {
    const auto key = op.find('+') != std::string::npos || is_p2p(op) ? std::string("p2p") : op;
    const auto it = model->target.find(key);
    lines = it == model->target.end() ? nullptr : &it->second;
  }
  if (lines == nullptr) {
    return c;
  }
  const auto real = model->real.find(op.find('+') != std::string::npos ? std::string("send") : op);
  c.paced = true;
  c.model = model;
  const bool p2p = is_p2p(op) && peer >= 0 && static_cast<size_t>(peer) < model->peers.size();
  c.kind = p2p ? (op == "send" ? 1 : 2) : 0;
  c.peer = p2p ? peer : -1;
  c.target_ns = static_cast<int64_t>(g_dilation.load() * lines->seconds(bytes) * 1e9);
  c.real_ns = real == model->real.end() ? 0 : static_cast<int64_t>(real->second.seconds(bytes) * 1e9);
  return c;
}

c10::intrusive_ptr<c10d::Work> pace(
    c10::intrusive_ptr<c10d::Work> work,
    Start start,
    int64_t cuda_slot,
    const Cost& c,
    const at::Device& device) {
  if (!work) {
    return work;
  }
  ++g_paced;
  if (device.is_cuda()) {
    return c10::make_intrusive<PacedCudaWork>(std::move(work), device, cuda_slot, c.real_ns, c.target_ns);
  }
  return c10::make_intrusive<PacedWork>(std::move(work), std::move(start), c.target_ns);
}

int64_t cuda_stamp(const at::Device& device) {
  const CudaStamp stamp = g_cuda_stamp.load();
  TORCH_CHECK(
      stamp != nullptr && g_cuda_hold.load() != nullptr,
      "workbench emulation: CUDA collectives need the CUDA library's pacer "
      "(workbench.emulation.rank installs it; build it with python -m workbench.doctor --build)");
  const int64_t slot = stamp(device.index(), stream_of(device));
  TORCH_CHECK(slot >= 0, "workbench emulation: stamping the start failed (CUDA error ", -slot, ")");
  return slot;
}

} // namespace

bool emulation_on() {
  return g_on.load(std::memory_order_relaxed);
}

IssueFn emulated(
    const IssueFn& issue,
    const std::string& uid,
    const char* op,
    int64_t bytes,
    int peer,
    const at::Device& device) {
  const Cost c = cost_of(uid, op, bytes, peer);
  if (!c.paced) {
    return issue;
  }
  return [issue, c, device](c10d::Backend& backend) {
    // On CUDA the start is a GPU-clock stamp on the caller's stream, which the
    // collective's stream waits for: the moment it could start.
    const int64_t slot = device.is_cuda() ? cuda_stamp(device) : 0;
    Start start = arrive(c, now_ns());
    return pace(issue(backend), std::move(start), slot, c, device);
  };
}

c10::intrusive_ptr<c10d::Work> emulated_batch(
    c10::intrusive_ptr<c10d::Work> work,
    const std::string& uid,
    const std::string& op,
    int64_t bytes,
    int64_t start_ns,
    const at::Device& device) {
  if (!emulation_on()) {
    return work;
  }
  const Cost c = cost_of(uid, op, bytes, -1);
  if (!c.paced) {
    return work;
  }
  // A batch's start was not stamped on the GPU: its hold counts from when the batch is done.
  const int64_t slot = device.is_cuda() ? cuda_stamp(device) : 0;
  Start start; // a batch's peers are several: its start is estimated, not read
  start.own_ns = start_ns;
  start.real_ns = c.real_ns;
  return pace(std::move(work), std::move(start), slot, c, device);
}

// --- Python ----------------------------------------------------------------------

namespace {

using PyLines = std::vector<std::pair<double, double>>;

Lines to_lines(const PyLines& in) {
  Lines out;
  for (const auto& [latency, per_byte] : in) {
    out.lines.push_back({latency, per_byte});
  }
  return out;
}

} // namespace

void bind_emulation(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "emulation_set_group",
      [](const std::string& uid,
         const std::unordered_map<std::string, PyLines>& target,
         const std::vector<PyLines>& peers,
         const std::unordered_map<std::string, PyLines>& real,
         int me,
         const std::string& arrivals,
         size_t offset) {
        auto model = std::make_shared<GroupModel>();
        const int n = static_cast<int>(peers.size());
        model->me = me;
        if (!arrivals.empty()) {
          model->arrivals = std::make_shared<Arrivals>(arrivals, offset, n, me);
        }
        for (const auto& [kind, lines] : target) {
          model->target[kind] = to_lines(lines);
        }
        for (const auto& lines : peers) {
          model->peers.push_back(to_lines(lines));
        }
        for (const auto& [kind, lines] : real) {
          model->real[kind] = to_lines(lines);
        }
        std::lock_guard<std::mutex> lock(g_mu);
        auto& counters = g_counters[uid];
        if (!counters) {
          counters = std::make_shared<Counters>(n);
        }
        model->counters = counters;
        g_groups[uid] = std::move(model);
        refresh_on_locked();
      },
      py::arg("uid"),
      py::arg("target"),
      py::arg("peers"),
      py::arg("real"),
      py::arg("me"),
      py::arg("arrivals") = "",
      py::arg("offset") = 0);
  m.def("emulation_arrivals_bytes", [](int n) { return Arrivals::bytes_for(n); }, py::arg("group_size"));
  m.def("emulation_clear", [] {
    std::lock_guard<std::mutex> lock(g_mu);
    g_groups.clear();
    refresh_on_locked();
  });
  m.def(
      "emulation_set_dilation",
      [](double dilation) {
        std::lock_guard<std::mutex> lock(g_mu);
        g_dilation.store(dilation);
        refresh_on_locked();
      },
      py::arg("dilation"));
  m.def("emulation_dilation", [] { return g_dilation.load(); });
  m.def("emulation_on", &emulation_on);
  m.def("emulation_groups", [] {
    std::lock_guard<std::mutex> lock(g_mu);
    std::vector<std::string> out;
    for (const auto& [uid, _] : g_groups) {
      out.push_back(uid);
    }
    return out;
  });
  // (collectives paced, of which the real transfer outlasted the emulated time)
  m.def("emulation_counts", [] { return py::make_tuple(g_paced.load(), g_overruns.load()); });
  m.def(
      "emulation_set_cuda_pacer",
      [](uintptr_t stamp, uintptr_t hold) {
        g_cuda_stamp.store(reinterpret_cast<CudaStamp>(stamp));
        g_cuda_hold.store(reinterpret_cast<CudaHold>(hold));
      },
      py::arg("stamp"),
      py::arg("hold"));
}

} // namespace wbt
