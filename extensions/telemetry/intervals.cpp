#include "intervals.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace wbt {

std::vector<Span> merge(std::vector<Span> spans) {
  for (const auto& s : spans) {
    if (s.end < s.start) {
      throw std::invalid_argument(
          "interval ends before it starts: [" + std::to_string(s.start) +
          ", " + std::to_string(s.end) + ")");
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) {
    return x.start < y.start;
  });
  std::vector<Span> out;
  out.reserve(spans.size());
  for (const auto& s : spans) {
    if (s.end == s.start) {
      continue;
    }
    // Touching spans ([0,5) and [5,9)) join: no instant lies between them.
    if (!out.empty() && s.start <= out.back().end) {
      out.back().end = std::max(out.back().end, s.end);
    } else {
      out.push_back(s);
    }
  }
  return out;
}

int64_t union_length(const std::vector<Span>& spans) {
  int64_t total = 0;
  for (const auto& s : merge(spans)) {
    total += s.end - s.start;
  }
  return total;
}

std::vector<Span> intersection(
    const std::vector<Span>& a,
    const std::vector<Span>& b) {
  const auto x = merge(a);
  const auto y = merge(b);
  std::vector<Span> out;
  // Both lists are sorted and disjoint, so one sweep visits every pair that
  // can meet; advance whichever span ends first.
  size_t i = 0, j = 0;
  while (i < x.size() && j < y.size()) {
    const int64_t lo = std::max(x[i].start, y[j].start);
    const int64_t hi = std::min(x[i].end, y[j].end);
    if (lo < hi) {
      out.push_back({lo, hi});
    }
    if (x[i].end < y[j].end) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

StepOverlap step_overlap(
    const std::vector<Span>& compute,
    const std::vector<Span>& comm) {
  StepOverlap r{};
  r.comm_ns = union_length(comm);
  for (const auto& s : intersection(comm, compute)) {
    r.overlapped_ns += s.end - s.start;
  }
  r.exposed_ns = r.comm_ns - r.overlapped_ns;
  return r;
}

} // namespace wbt
