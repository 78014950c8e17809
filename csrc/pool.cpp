#include "pool.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <string>
#include <utility>

namespace graph_exec {

std::size_t size_class_index(std::uint64_t nbytes) {
    if (nbytes <= 256) {
        return static_cast<std::size_t>((nbytes + 63) / 64 - 1);
    }
    const int octave = 63 - __builtin_clzll(nbytes - 1);  // 2^octave < nbytes <= 2^(octave+1)
    const std::uint64_t step = std::uint64_t{1} << (octave - 2);
    const std::uint64_t sub = (nbytes - (std::uint64_t{1} << octave) + step - 1) / step;  // 1..4
    return static_cast<std::size_t>(4 + 4 * (octave - 8) + (sub - 1));
}

std::uint64_t size_class_bytes(std::size_t index) {
    if (index < 4) {
        return kAlignment * (index + 1);
    }
    const std::size_t octave = 8 + (index - 4) / 4;
    const std::size_t sub = 1 + (index - 4) % 4;
    return (std::uint64_t{1} << octave) + sub * (std::uint64_t{1} << (octave - 2));
}

Memory::Memory(std::uint64_t bytes) : data_(std::aligned_alloc(kAlignment, bytes)) {
    if (data_ == nullptr) {
        throw std::bad_alloc();
    }
}

Memory::~Memory() { std::free(data_); }

Block::Block(std::shared_ptr<Pool> pool, std::uint64_t nbytes, std::size_t size_class)
    : pool_(std::move(pool)), nbytes_(nbytes), size_class_(size_class) {}

Block::~Block() {
    try {
        std::lock_guard<std::mutex> lock(pool_->mutex_);
        if (!released_.load()) {
            pool_->give_back_locked(*this, /*automatic=*/true);
        }
    } catch (...) {
        // Only a failing free-list push gets here; the memory is then simply freed with the block.
    }
}

void *Block::data() const {
    if (released_.load()) {
        throw PoolError("block was released to its BufferPool and must not be used; acquire a new one");
    }
    return memory_->data();
}

Pool::Pool(std::int64_t max_block_bytes) : max_block_bytes_(max_block_bytes) {
    if (max_block_bytes < 1 || max_block_bytes > kMaxBlockLimit) {
        throw PoolError("max_block_bytes must be in [1, " + std::to_string(kMaxBlockLimit) + "], got " +
                        std::to_string(max_block_bytes));
    }
    free_.resize(size_class_index(static_cast<std::uint64_t>(max_block_bytes)) + 1);
}

std::unique_ptr<Block> Pool::acquire(std::int64_t nbytes) {
    if (nbytes < 1 || nbytes > max_block_bytes_) {
        throw PoolError("nbytes must be in [1, " + std::to_string(max_block_bytes_) +
                        "] (max_block_bytes), got " + std::to_string(nbytes));
    }
    const std::size_t size_class = size_class_index(static_cast<std::uint64_t>(nbytes));
    const std::uint64_t capacity = size_class_bytes(size_class);
    // The block object exists (not yet live) before the stats change, so each locked section below
    // leaves the stats consistent (reserved = live + free) for a concurrent stats() call.
    auto block = std::make_unique<Block>(shared_from_this(), static_cast<std::uint64_t>(nbytes), size_class);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        auto &list = free_[size_class];
        if (!list.empty()) {
            std::shared_ptr<Memory> memory = std::move(list.back());
            list.pop_back();
            --stats_.free_blocks;
            ++stats_.reuses;
            hand_out_locked(*block, std::move(memory));
            return block;
        }
    }
    auto memory = std::make_shared<Memory>(capacity);  // outside the lock: large allocations take a while
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.allocations;
    stats_.reserved_bytes += capacity;
    hand_out_locked(*block, std::move(memory));
    return block;
}

void Pool::hand_out_locked(Block &block, std::shared_ptr<Memory> memory) {
    block.memory_ = std::move(memory);
    block.released_.store(false);
    ++stats_.acquires;
    ++stats_.live_blocks;
    stats_.live_bytes += block.capacity();
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes);
}

void Pool::release(Block &block) {
    if (block.pool_.get() != this) {
        throw PoolError("block belongs to another BufferPool");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (block.released_.load()) {
        throw PoolError("block was already released (double release)");
    }
    give_back_locked(block, /*automatic=*/false);
}

void Pool::give_back_locked(Block &block, bool automatic) {
    free_[block.size_class_].push_back(block.memory_);
    block.released_.store(true);
    ++stats_.free_blocks;
    ++stats_.releases;
    stats_.auto_releases += automatic ? 1 : 0;
    --stats_.live_blocks;
    stats_.live_bytes -= block.capacity();
}

std::uint64_t Pool::trim() {
    std::vector<std::vector<std::shared_ptr<Memory>>> unused(free_.size());
    std::uint64_t freed = 0;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (std::size_t size_class = 0; size_class < free_.size(); ++size_class) {
            freed += free_[size_class].size() * size_class_bytes(size_class);
            unused[size_class].swap(free_[size_class]);
        }
        stats_.reserved_bytes -= freed;
        stats_.free_blocks = 0;
    }
    return freed;  // `unused` is destroyed here, outside the lock
}

PoolStats Pool::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
}

}  // namespace graph_exec
