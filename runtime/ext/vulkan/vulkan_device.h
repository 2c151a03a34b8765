/*!
 * \file vulkan_device.h
 * \brief gimlet's Vulkan device: instance and device selection, buffers, command recording.
 *
 * One process-wide `VulkanContext` owns the Vulkan instance and one `VulkanDevice` per
 * physical device. Every TVM buffer on a Vulkan device is a `VulkanBuffer` (the `void*` data
 * pointer TVM hands around points to it). Memory is always host-visible and coherent (every
 * Vulkan implementation has such a memory type), so host<->device copies are memcpy through
 * a persistent mapping once the device's queued work has finished. On lavapipe all memory is
 * host memory anyway; on a discrete GPU this trades bandwidth for simplicity (noted in
 * runtime/vulkan_runtime.py).
 *
 * Kernel launches are recorded into one command buffer per device and submitted when the host
 * needs results (a copy, a stream sync, a full descriptor pool): see `VulkanDevice::Flush`.
 */
#ifndef GIMLET_VULKAN_DEVICE_H_
#define GIMLET_VULKAN_DEVICE_H_

#include <vulkan/vulkan.h>

#include <tvm/ffi/error.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace gimlet {
namespace vulkan {

/*! \brief Throw a TVM RuntimeError naming the failed Vulkan call and its result code. */
void CheckVk(VkResult result, const char* call);
#define GIMLET_VK_CALL(expr) ::gimlet::vulkan::CheckVk((expr), #expr)

/*! \brief One device allocation: a storage buffer bound to its own host-visible memory. */
struct VulkanBuffer {
  VkBuffer buffer{VK_NULL_HANDLE};
  VkDeviceMemory memory{VK_NULL_HANDLE};
  void* host{nullptr};  // persistent mapping of the whole allocation
  size_t size{0};
  int device_id{0};
};

/*! \brief Limits and facts read from the driver, used for checks and device attributes. */
struct DeviceLimits {
  std::string name;
  std::string kind;  // "cpu", "discrete_gpu", "integrated_gpu", "virtual_gpu", "other"
  uint32_t api_version{0};
  uint32_t driver_version{0};
  std::array<uint32_t, 3> max_workgroup_size{};
  std::array<uint32_t, 3> max_workgroup_count{};
  uint32_t max_workgroup_invocations{0};
  uint32_t max_shared_memory{0};
  uint32_t max_push_constants{0};
  uint32_t max_storage_buffers{0};
  uint64_t max_storage_buffer_range{0};
  uint32_t subgroup_size{1};
  uint64_t device_local_bytes{0};
  bool int64{false};
  bool float64{false};
  bool int8_storage{false};
};

class VulkanDevice {
 public:
  VulkanDevice(VkInstance instance, VkPhysicalDevice physical, int device_id);
  VulkanDevice(const VulkanDevice&) = delete;
  VulkanDevice& operator=(const VulkanDevice&) = delete;

  VkDevice handle() const { return device_; }
  const DeviceLimits& limits() const { return limits_; }

  VulkanBuffer* Allocate(size_t nbytes);
  /*! \brief Free `buffer`, after the queued work that may still use it has finished. */
  void Free(VulkanBuffer* buffer);

  /*!
   * \brief The command buffer being recorded (begun on demand) and a descriptor set for
   * `layout`. When the descriptor pool is exhausted the queued work is flushed first.
   */
  VkCommandBuffer Record(VkDescriptorSetLayout layout, VkDescriptorSet* set);
  /*! \brief Submit the recorded commands and wait for them; no-op when nothing is queued. */
  void Flush();

  /*! \brief Serializes use of this device's queue and command buffer between threads. */
  std::recursive_mutex& mutex() { return mutex_; }

 private:
  void ReadLimits(VkPhysicalDevice physical);
  void Release(VulkanBuffer* buffer);

  int device_id_;
  DeviceLimits limits_;
  VkDevice device_{VK_NULL_HANDLE};
  VkQueue queue_{VK_NULL_HANDLE};
  uint32_t memory_type_{0};
  VkCommandPool command_pool_{VK_NULL_HANDLE};
  VkCommandBuffer command_buffer_{VK_NULL_HANDLE};
  VkDescriptorPool descriptor_pool_{VK_NULL_HANDLE};
  VkFence fence_{VK_NULL_HANDLE};
  bool recording_{false};
  std::vector<VulkanBuffer*> deferred_frees_;  // freed while commands using them were queued
  std::recursive_mutex mutex_;
};

/*!
 * \brief The process-wide Vulkan instance and its devices, created on first use.
 * When no instance or device can be created, `error()` says why and `devices()` is empty.
 */
class VulkanContext {
 public:
  static VulkanContext& Global();
  const std::string& error() const { return error_; }
  size_t num_devices() const { return devices_.size(); }
  /*! \brief Device `id`; throws a RuntimeError saying why when it does not exist. */
  VulkanDevice& device(int id);

 private:
  VulkanContext();
  VkInstance instance_{VK_NULL_HANDLE};
  std::vector<std::unique_ptr<VulkanDevice>> devices_;
  std::string error_;
};

}  // namespace vulkan
}  // namespace gimlet

#endif  // GIMLET_VULKAN_DEVICE_H_
