// The emulation's shared arrivals; see emulation_arrivals.h.

#include "emulation_arrivals.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

namespace wbt::emulation {

namespace {

static_assert(std::atomic<int64_t>::is_always_lock_free, "arrivals are shared between processes");

void stamp(std::atomic<int64_t>* slot, int64_t seq, int64_t ns) {
  slot[1].store(ns, std::memory_order_relaxed);
  slot[0].store(seq + 1, std::memory_order_release); // the tag last: a reader never sees a stale time
}

int64_t read(const std::atomic<int64_t>* slot, int64_t seq, int64_t otherwise) {
  return slot[0].load(std::memory_order_acquire) == seq + 1 ? slot[1].load(std::memory_order_relaxed) : otherwise;
}

} // namespace

size_t Arrivals::bytes_for(int n) {
  return sizeof(int64_t) * (kSlots * n * 2 + static_cast<size_t>(n) * n * kP2pSlots * 4);
}

Arrivals::Arrivals(const std::string& path, size_t offset, int n, int me) : n_(n), me_(me), size_(bytes_for(n)) {
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

Arrivals::~Arrivals() {
  ::munmap(base_, size_);
}

void Arrivals::arrive(int64_t seq, int64_t ns) {
  stamp(coll(seq, me_), seq, ns);
}

int64_t Arrivals::last(int64_t seq, int64_t own_ns) const {
  int64_t latest = own_ns;
  for (int j = 0; j < n_; ++j) {
    latest = std::max(latest, read(coll(seq, j), seq, own_ns));
  }
  return latest;
}

void Arrivals::arrive_p2p(int src, int dst, int64_t k, bool sending, int64_t ns) {
  stamp(p2p(src, dst, k) + (sending ? 0 : 2), k, ns);
}

int64_t Arrivals::last_p2p(int src, int dst, int64_t k, int64_t own_ns) const {
  const auto* e = p2p(src, dst, k);
  return std::max({own_ns, read(e, k, own_ns), read(e + 2, k, own_ns)});
}

std::atomic<int64_t>* Arrivals::coll(int64_t seq, int rank) const {
  return base_ + ((seq % kSlots) * n_ + rank) * 2;
}

std::atomic<int64_t>* Arrivals::p2p(int src, int dst, int64_t k) const {
  return base_ + kSlots * n_ * 2 + ((static_cast<int64_t>(src) * n_ + dst) * kP2pSlots + k % kP2pSlots) * 4;
}

} // namespace wbt::emulation
