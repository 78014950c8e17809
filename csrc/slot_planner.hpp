// Offline slot planner: buffers with known lifetimes share slots when their lifetimes are disjoint.
#pragma once

#include <cstdint>
#include <vector>

namespace graph_exec {

// A buffer live from step `first` to step `last`, both inclusive.
struct Lifetime {
    std::int64_t first;
    std::int64_t last;
    std::int64_t nbytes;
};

struct SlotPlan {
    std::vector<std::int64_t> slot_of;     // slot id per input buffer
    std::vector<std::int64_t> slot_sizes;  // largest buffer assigned to each slot, non-increasing
    std::int64_t peak_bytes = 0;           // max over steps of the bytes live at that step
    std::int64_t total_bytes = 0;          // sum of slot_sizes
};

// Greedy by size with best fit: buffers in order of decreasing nbytes (ties by first, then last
// step) each go to the smallest existing slot whose buffers' lifetimes are all disjoint from
// theirs, else open a new slot. Throws PoolError on first > last, nbytes < 1 or a byte total
// beyond int64.
SlotPlan plan_slots(const std::vector<Lifetime> &lifetimes);

}  // namespace graph_exec
