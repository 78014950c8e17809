#include "slot_planner.hpp"

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

#include "pool.hpp"

namespace graph_exec {
namespace {

std::string describe(std::size_t index, const Lifetime &lt) {
    return "lifetimes[" + std::to_string(index) + "] = (" + std::to_string(lt.first) + ", " +
           std::to_string(lt.last) + ", " + std::to_string(lt.nbytes) + ")";
}

void validate(const std::vector<Lifetime> &lifetimes) {
    std::int64_t sum = 0;
    for (std::size_t i = 0; i < lifetimes.size(); ++i) {
        const Lifetime &lt = lifetimes[i];
        if (lt.first > lt.last) {
            throw PoolError(describe(i, lt) + ": first_step must be <= last_step");
        }
        if (lt.nbytes < 1) {
            throw PoolError(describe(i, lt) + ": nbytes must be >= 1");
        }
        if (__builtin_add_overflow(sum, lt.nbytes, &sum)) {
            throw PoolError(describe(i, lt) + ": the sum of all nbytes exceeds 2**63 - 1");
        }
    }
}

// Max over steps of the bytes live at that step (a lower bound for any slot assignment).
std::int64_t peak_live_bytes(const std::vector<Lifetime> &lifetimes) {
    std::vector<std::pair<std::int64_t, std::int64_t>> starts, ends;  // (step, nbytes)
    starts.reserve(lifetimes.size());
    ends.reserve(lifetimes.size());
    for (const Lifetime &lt : lifetimes) {
        starts.emplace_back(lt.first, lt.nbytes);
        ends.emplace_back(lt.last, lt.nbytes);
    }
    std::sort(starts.begin(), starts.end());
    std::sort(ends.begin(), ends.end());
    std::int64_t live = 0, peak = 0;
    auto end = ends.begin();
    for (const auto &[step, nbytes] : starts) {
        // A lifetime still counts at its last step. The loop stops in range: the lifetime that
        // starts at `step` has not ended before it.
        for (; end->first < step; ++end) {
            live -= end->second;
        }
        live += nbytes;
        peak = std::max(peak, live);
    }
    return peak;
}

// The lifetimes assigned to one slot, pairwise disjoint, as (first, last) sorted by first: a main
// array plus a small side array that is merged in once it outgrows sqrt(main). Lookups are binary
// searches over contiguous memory; an insert costs O(sqrt(n)) amortized.
class Slot {
  public:
    explicit Slot(const Lifetime &lt) : size_(lt.nbytes), main_{{lt.first, lt.last}} {}

    std::int64_t size() const { return size_; }

    bool is_free(std::int64_t first, std::int64_t last) const {
        return is_free_in(main_, first, last) && is_free_in(side_, first, last);
    }

    void add(const Lifetime &lt) {
        side_.insert(next_after(side_, lt.first), {lt.first, lt.last});
        if (side_.size() * side_.size() > main_.size()) {
            const auto middle = static_cast<std::ptrdiff_t>(main_.size());
            main_.insert(main_.end(), side_.begin(), side_.end());
            std::inplace_merge(main_.begin(), main_.begin() + middle, main_.end());
            side_.clear();
        }
    }

  private:
    using Span = std::pair<std::int64_t, std::int64_t>;

    // First span starting after `step`.
    static std::vector<Span>::const_iterator next_after(const std::vector<Span> &spans, std::int64_t step) {
        return std::upper_bound(spans.begin(), spans.end(), step,
                                [](std::int64_t s, const Span &span) { return s < span.first; });
    }

    static bool is_free_in(const std::vector<Span> &spans, std::int64_t first, std::int64_t last) {
        const auto next = next_after(spans, last);
        return next == spans.begin() || std::prev(next)->second < first;
    }

    std::int64_t size_;
    std::vector<Span> main_, side_;
};

}  // namespace

SlotPlan plan_slots(const std::vector<Lifetime> &lifetimes) {
    validate(lifetimes);
    struct Item {
        Lifetime lifetime;
        std::size_t index;
    };
    std::vector<Item> order(lifetimes.size());
    for (std::size_t i = 0; i < lifetimes.size(); ++i) {
        order[i] = {lifetimes[i], i};
    }
    std::sort(order.begin(), order.end(), [](const Item &x, const Item &y) {
        const Lifetime &a = x.lifetime, &b = y.lifetime;
        if (a.nbytes != b.nbytes) return a.nbytes > b.nbytes;
        if (a.first != b.first) return a.first < b.first;
        if (a.last != b.last) return a.last < b.last;
        return x.index < y.index;
    });

    SlotPlan plan;
    plan.slot_of.assign(lifetimes.size(), -1);
    std::vector<Slot> slots;
    for (const auto &[lt, i] : order) {
        // Slots are opened in order of decreasing size, so the newest free one wastes the least.
        std::size_t s = slots.size();
        while (s > 0 && !slots[s - 1].is_free(lt.first, lt.last)) {
            --s;
        }
        if (s == 0) {
            slots.emplace_back(lt);
            s = slots.size();
        } else {
            slots[s - 1].add(lt);
        }
        plan.slot_of[i] = static_cast<std::int64_t>(s - 1);
    }
    for (const Slot &slot : slots) {
        plan.slot_sizes.push_back(slot.size());
        plan.total_bytes += slot.size();
    }
    plan.peak_bytes = peak_live_bytes(lifetimes);
    return plan;
}

}  // namespace graph_exec
