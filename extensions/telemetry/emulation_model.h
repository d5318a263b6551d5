#pragma once

// The emulation's model (emulation.h says what it is for): per emulated
// group, the lines of each kind (workbench/links.py computes them), what a
// collective of the group costs, and when it started and may complete.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "emulation_arrivals.h"

namespace wbt::emulation {

struct Line {
  double latency_s = 0;
  double seconds_per_byte = 0;
};

// The time of a transfer: the lowest of a few lines.
struct Lines {
  std::vector<Line> lines;
  double seconds(int64_t bytes) const;
};

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

// --- the emulated groups, by uid -------------------------------------------------

// Installs or reprices `uid`'s model; its counters outlive a repricing (calibrate, install): ranks keep
// agreeing on the index.
void set_group(const std::string& uid, std::shared_ptr<GroupModel> model);
void clear_groups();
std::vector<std::string> group_uids();
void set_dilation(double dilation);
double dilation();
// Whether any group is emulated now (one relaxed atomic load): emulation_on() of emulation.h.
bool on();

// (collectives paced, of which the real transfer outlasted the emulated time)
void count_paced();
std::pair<uint64_t, uint64_t> counts();

// --- one collective ----------------------------------------------------------------

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

  int64_t at(int64_t real_end_ns) const;
};

// When the collective may report completion: its start plus the dilated target time.
int64_t deadline_ns(const Start& start, int64_t real_end_ns, int64_t target_ns);

struct Cost {
  bool paced = false;
  int64_t target_ns = 0; // dilated
  int64_t real_ns = 0;
  std::shared_ptr<const GroupModel> model;
  int kind = 0; // Start::kind
  int peer = -1;
};

// What `op` of `bytes` costs on group `uid` (`peer`: the group rank at the other end of a send/recv, else -1);
// not paced when the group or the kind is not emulated.
Cost cost_of(const std::string& uid, const std::string& op, int64_t bytes, int peer);

// Stamps this rank's arrival (where the group shares arrivals) and returns the start to resolve later.
Start arrive(const Cost& c, int64_t now);

} // namespace wbt::emulation
