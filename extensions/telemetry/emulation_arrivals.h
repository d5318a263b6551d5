#pragma once

// When each rank of a group issued its collectives, in memory every rank of
// the group maps (ranks on one host share CLOCK_MONOTONIC): after a
// collective ends for real, a rank reads when its last peer arrived instead
// of estimating it. Slots are tagged with the sequence number + 1 they hold,
// so a slot still holding an older collective is never read as this one.
//   collectives: [kSlots][n] of {tag, ns}: rank j's k-th collective of the group;
//   p2p:         [n][n][kP2pSlots] of {send tag, send ns, recv tag, recv ns}: the k-th transfer src -> dst.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace wbt::emulation {

class Arrivals {
 public:
  static constexpr int64_t kSlots = 256;
  static constexpr int64_t kP2pSlots = 64;

  static size_t bytes_for(int n);

  // Maps `bytes_for(n)` bytes of `path` at `offset` (page-aligned), creating or growing the file.
  Arrivals(const std::string& path, size_t offset, int n, int me);
  ~Arrivals();
  Arrivals(const Arrivals&) = delete;
  Arrivals& operator=(const Arrivals&) = delete;

  // This rank issues its `seq`-th collective of the group at `ns`.
  void arrive(int64_t seq, int64_t ns);
  // The latest issue of the `seq`-th collective over the ranks that have stamped it.
  int64_t last(int64_t seq, int64_t own_ns) const;
  // The k-th transfer from src to dst: a send stamps its side, a recv the other.
  void arrive_p2p(int src, int dst, int64_t k, bool sending, int64_t ns);
  int64_t last_p2p(int src, int dst, int64_t k, int64_t own_ns) const;

 private:
  std::atomic<int64_t>* coll(int64_t seq, int rank) const;
  std::atomic<int64_t>* p2p(int src, int dst, int64_t k) const;

  int n_, me_;
  size_t size_;
  std::atomic<int64_t>* base_ = nullptr;
};

} // namespace wbt::emulation
