// The emulation's model and its registry of groups; see emulation_model.h.

#include "emulation_model.h"

#include <algorithm>
#include <limits>
#include <mutex>

namespace wbt::emulation {

namespace {

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

bool is_p2p(const std::string& op) {
  return op == "send" || op == "recv";
}

} // namespace

double Lines::seconds(int64_t bytes) const {
  double best = std::numeric_limits<double>::infinity();
  for (const auto& l : lines) {
    best = std::min(best, l.latency_s + static_cast<double>(bytes) * l.seconds_per_byte);
  }
  return lines.empty() ? 0.0 : best;
}

void set_group(const std::string& uid, std::shared_ptr<GroupModel> model) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& counters = g_counters[uid];
  if (!counters) {
    counters = std::make_shared<Counters>(static_cast<int>(model->peers.size()));
  }
  model->counters = counters;
  g_groups[uid] = std::move(model);
  refresh_on_locked();
}

void clear_groups() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_groups.clear();
  refresh_on_locked();
}

std::vector<std::string> group_uids() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<std::string> out;
  for (const auto& [uid, _] : g_groups) {
    out.push_back(uid);
  }
  return out;
}

void set_dilation(double dilation) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_dilation.store(dilation);
  refresh_on_locked();
}

double dilation() {
  return g_dilation.load();
}

bool on() {
  return g_on.load(std::memory_order_relaxed);
}

void count_paced() {
  ++g_paced;
}

std::pair<uint64_t, uint64_t> counts() {
  return {g_paced.load(), g_overruns.load()};
}

int64_t Start::at(int64_t real_end_ns) const {
  if (!arrivals) {
    return std::max(own_ns, real_end_ns - real_ns);
  }
  return kind == 0 ? arrivals->last(index, own_ns) : arrivals->last_p2p(src, dst, index, own_ns);
}

int64_t deadline_ns(const Start& start, int64_t real_end_ns, int64_t target_ns) {
  const int64_t deadline = start.at(real_end_ns) + target_ns;
  if (deadline <= real_end_ns) {
    ++g_overruns; // this machine was slower than the emulated cluster: the real time stands
  }
  return deadline;
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

} // namespace wbt::emulation
