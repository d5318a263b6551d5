#pragma once

// Interval arithmetic over one rank's timeline: the measure behind
// "communication time", "exposed communication" and "overlap".
// Spans are half-open [start, end) in nanoseconds; no torch headers here so
// this compiles fast and can be reasoned about on its own.

#include <cstdint>
#include <vector>

namespace wbt {

struct Span {
  int64_t start;
  int64_t end;
};

// Sorted, disjoint spans covering exactly the instants of `spans`.
// Empty spans vanish; a span ending before it starts is a caller bug and throws.
std::vector<Span> merge(std::vector<Span> spans);

// Total time covered by at least one span (overlaps counted once).
int64_t union_length(const std::vector<Span>& spans);

// Instants covered by both sets, as merged spans.
std::vector<Span> intersection(
    const std::vector<Span>& a,
    const std::vector<Span>& b);

struct StepOverlap {
  int64_t comm_ns; // union of communication
  int64_t exposed_ns; // communication while no computation runs
  int64_t overlapped_ns; // communication while computation also runs
};

StepOverlap step_overlap(
    const std::vector<Span>& compute,
    const std::vector<Span>& comm);

} // namespace wbt
