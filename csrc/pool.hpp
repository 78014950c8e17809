// Size-class pool of 64-byte aligned host blocks (pure C++; the Python binding lives in bufpool.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace graph_exec {

// Every misuse the pool or the planner detects; Python sees it as BufferPoolError (a ValueError).
struct PoolError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

constexpr std::uint64_t kAlignment = 64;
// Largest max_block_bytes a pool accepts: every class size up to it fits in 63 bits.
constexpr std::int64_t kMaxBlockLimit = std::int64_t{1} << 62;

// Size classes: 64, 128, 192, 256, then four per octave above 256 bytes
// (2^k * 5/4, 6/4, 7/4, 8/4 for k >= 8). A request of n bytes gets the smallest class >= n, so
// the waste is under 64 bytes for n <= 256 and under n / 4 above (capacity < 1.25 * n).
std::size_t size_class_index(std::uint64_t nbytes);  // nbytes in [1, kMaxBlockLimit]
std::uint64_t size_class_bytes(std::size_t index);

// One aligned host allocation, freed when its last owner (pool free list or Block) lets go.
class Memory {
  public:
    explicit Memory(std::uint64_t bytes);  // throws std::bad_alloc
    ~Memory();
    Memory(const Memory &) = delete;
    Memory &operator=(const Memory &) = delete;
    void *data() const { return data_; }

  private:
    void *data_;
};

struct PoolStats {
    std::uint64_t acquires = 0;       // successful acquire calls
    std::uint64_t allocations = 0;    // acquires that had to allocate fresh memory
    std::uint64_t reuses = 0;         // acquires served from a free list
    std::uint64_t releases = 0;       // blocks given back, explicitly or on garbage collection
    std::uint64_t auto_releases = 0;  // of those, blocks collected while still live
    std::uint64_t live_blocks = 0;
    std::uint64_t live_bytes = 0;      // capacity of live blocks
    std::uint64_t peak_bytes = 0;      // high-water mark of live_bytes
    std::uint64_t reserved_bytes = 0;  // capacity the pool holds: live + free
    std::uint64_t free_blocks = 0;
};

class Pool;

// A block handed out by a pool. It keeps its memory alive for as long as the object exists, also
// after release, so buffers exported from it can never dangle; once released, data() refuses.
class Block {
  public:
    // Created by Pool::acquire, not live until the pool hands it memory.
    Block(std::shared_ptr<Pool> pool, std::uint64_t nbytes, std::size_t size_class);
    ~Block();  // a block collected while live goes back to its pool
    Block(const Block &) = delete;
    Block &operator=(const Block &) = delete;

    std::uint64_t nbytes() const { return nbytes_; }
    std::uint64_t capacity() const { return size_class_bytes(size_class_); }
    bool released() const { return released_.load(); }
    std::uintptr_t address() const { return reinterpret_cast<std::uintptr_t>(memory_->data()); }
    void *data() const;  // throws PoolError once released

  private:
    friend class Pool;
    std::shared_ptr<Pool> pool_;
    std::shared_ptr<Memory> memory_;
    std::uint64_t nbytes_;
    std::size_t size_class_;
    std::atomic<bool> released_{true};
};

class Pool : public std::enable_shared_from_this<Pool> {
  public:
    explicit Pool(std::int64_t max_block_bytes);  // must be in [1, kMaxBlockLimit]

    std::unique_ptr<Block> acquire(std::int64_t nbytes);  // nbytes in [1, max_block_bytes]
    void release(Block &block);                           // throws on double or foreign release
    std::uint64_t trim();                                 // frees the free lists, returns bytes
    PoolStats stats() const;
    std::int64_t max_block_bytes() const { return max_block_bytes_; }

  private:
    friend class Block;
    void hand_out_locked(Block &block, std::shared_ptr<Memory> memory);
    void give_back_locked(Block &block, bool automatic);

    const std::int64_t max_block_bytes_;
    mutable std::mutex mutex_;
    std::vector<std::vector<std::shared_ptr<Memory>>> free_;  // indexed by size class
    PoolStats stats_;
};

}  // namespace graph_exec
