// fgpu's C++ hooks: what PyTorch asks a PrivateUse1 device for in C++ and a backend served
// from Python cannot give (torch._C._acc's Python hooks forward only is_available,
// is_built and has_primary_context). Here: pinned host memory, as CUDA's host allocator
// gives it, CPU memory whose blocks are remembered, so that is_pinned() is true for any
// pointer inside a live one. Generators, device counts and pointers' devices stay the base
// class's, as under the Python hooks. Built and registered by native.py (before fgpu's
// Python registration, which then keeps these).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>

namespace {

std::mutex blocks_lock;
std::map<std::uintptr_t, std::size_t> blocks;  // each live pinned block: its first byte -> its bytes

void release(void* ptr) {
  {
    std::lock_guard<std::mutex> hold(blocks_lock);
    blocks.erase(reinterpret_cast<std::uintptr_t>(ptr));
  }
  c10::free_cpu(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  // As CUDA's host allocator: zero bytes are no block (a null pointer, not pinned).
  c10::DataPtr allocate(std::size_t nbytes) override {
    void* ptr = nbytes == 0 ? nullptr : c10::alloc_cpu(nbytes);
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> hold(blocks_lock);
      blocks[reinterpret_cast<std::uintptr_t>(ptr)] = nbytes;
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }

  c10::Allocator* getPinnedMemoryAllocator() const override {
    static PinnedAllocator allocator;
    return &allocator;
  }

  bool isPinnedPtr(const void* data) const override {
    auto at = reinterpret_cast<std::uintptr_t>(data);
    std::lock_guard<std::mutex> hold(blocks_lock);
    auto after = blocks.upper_bound(at);
    if (after == blocks.begin()) {
      return false;
    }
    auto block = std::prev(after);
    return at < block->first + block->second;
  }
};

}  // namespace

// 1 if these hooks are now PrivateUse1's, 0 if another's were registered first.
extern "C" int parakit_register_hooks() {
  if (at::isPrivateUse1HooksRegistered()) {
    return 0;
  }
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return 1;
}
