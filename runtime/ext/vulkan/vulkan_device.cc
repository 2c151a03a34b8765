/*!
 * \file vulkan_device.cc
 * \brief The Vulkan instance, devices and TVM `DeviceAPI` (`device_api.vulkan`).
 */
#include "vulkan_device.h"

#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/runtime/device_api.h>

#include <cstring>
#include <sstream>

namespace gimlet {
namespace vulkan {

namespace {

// Descriptor sets per pool before the queued work is flushed and the pool reset.
constexpr uint32_t kDescriptorSetsPerPool = 1024;
// Storage-buffer descriptors per pool (kernels bind a handful of buffers each).
constexpr uint32_t kBuffersPerPool = kDescriptorSetsPerPool * 16;

const char* ResultName(VkResult result) {
  switch (result) {
    case VK_SUCCESS: return "VK_SUCCESS";
    case VK_ERROR_OUT_OF_HOST_MEMORY: return "VK_ERROR_OUT_OF_HOST_MEMORY";
    case VK_ERROR_OUT_OF_DEVICE_MEMORY: return "VK_ERROR_OUT_OF_DEVICE_MEMORY";
    case VK_ERROR_INITIALIZATION_FAILED: return "VK_ERROR_INITIALIZATION_FAILED";
    case VK_ERROR_DEVICE_LOST: return "VK_ERROR_DEVICE_LOST";
    case VK_ERROR_LAYER_NOT_PRESENT: return "VK_ERROR_LAYER_NOT_PRESENT";
    case VK_ERROR_EXTENSION_NOT_PRESENT: return "VK_ERROR_EXTENSION_NOT_PRESENT";
    case VK_ERROR_FEATURE_NOT_PRESENT: return "VK_ERROR_FEATURE_NOT_PRESENT";
    case VK_ERROR_INCOMPATIBLE_DRIVER: return "VK_ERROR_INCOMPATIBLE_DRIVER";
    case VK_ERROR_OUT_OF_POOL_MEMORY: return "VK_ERROR_OUT_OF_POOL_MEMORY";
    case VK_ERROR_INVALID_SHADER_NV: return "VK_ERROR_INVALID_SHADER_NV";
    default: return "VkResult";
  }
}

std::string VersionString(uint32_t version) {
  std::ostringstream os;
  os << VK_API_VERSION_MAJOR(version) << "." << VK_API_VERSION_MINOR(version) << "."
     << VK_API_VERSION_PATCH(version);
  return os.str();
}

const char* DeviceKindName(VkPhysicalDeviceType type) {
  switch (type) {
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return "cpu";
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return "discrete_gpu";
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return "integrated_gpu";
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return "virtual_gpu";
    default: return "other";
  }
}

}  // namespace

void CheckVk(VkResult result, const char* call) {
  if (result != VK_SUCCESS) {
    TVM_FFI_THROW(RuntimeError) << "Vulkan call failed: " << call << " returned "
                                << ResultName(result) << " (" << static_cast<int>(result) << ")";
  }
}

// ---------------------------------------------------------------------------------------------
// VulkanDevice

VulkanDevice::VulkanDevice(VkInstance instance, VkPhysicalDevice physical, int device_id)
    : device_id_(device_id) {
  ReadLimits(physical);

  uint32_t num_families = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(physical, &num_families, nullptr);
  std::vector<VkQueueFamilyProperties> families(num_families);
  vkGetPhysicalDeviceQueueFamilyProperties(physical, &num_families, families.data());
  uint32_t family = num_families;
  for (uint32_t i = 0; i < num_families; ++i) {
    if (families[i].queueFlags & VK_QUEUE_COMPUTE_BIT) {
      family = i;
      break;
    }
  }
  if (family == num_families) {
    TVM_FFI_THROW(RuntimeError) << "Vulkan device '" << limits_.name << "' has no compute queue";
  }

  // Enable exactly the optional features the shaders may use and the device has.
  VkPhysicalDeviceVulkan12Features features12{};
  features12.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES;
  features12.storageBuffer8BitAccess = limits_.int8_storage;
  features12.shaderInt8 = limits_.int8_storage;
  VkPhysicalDeviceFeatures2 features{};
  features.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2;
  features.features.shaderInt64 = limits_.int64;
  features.features.shaderFloat64 = limits_.float64;
  if (limits_.api_version >= VK_API_VERSION_1_2) features.pNext = &features12;

  float priority = 1.0f;
  VkDeviceQueueCreateInfo queue_info{};
  queue_info.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO;
  queue_info.queueFamilyIndex = family;
  queue_info.queueCount = 1;
  queue_info.pQueuePriorities = &priority;
  VkDeviceCreateInfo device_info{};
  device_info.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO;
  device_info.pNext = &features;
  device_info.queueCreateInfoCount = 1;
  device_info.pQueueCreateInfos = &queue_info;
  GIMLET_VK_CALL(vkCreateDevice(physical, &device_info, nullptr, &device_));
  vkGetDeviceQueue(device_, family, 0, &queue_);

  // Host-visible, coherent memory, device-local too where there is such a type.
  VkPhysicalDeviceMemoryProperties memory{};
  vkGetPhysicalDeviceMemoryProperties(physical, &memory);
  const VkMemoryPropertyFlags host = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT |
                                     VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
  int best = -1;
  for (uint32_t i = 0; i < memory.memoryTypeCount; ++i) {
    VkMemoryPropertyFlags flags = memory.memoryTypes[i].propertyFlags;
    if ((flags & host) != host) continue;
    if (best < 0 || (flags & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)) {
      best = static_cast<int>(i);
      if (flags & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT) break;
    }
  }
  TVM_FFI_ICHECK_GE(best, 0) << "Vulkan device has no host-visible coherent memory";
  memory_type_ = static_cast<uint32_t>(best);

  VkCommandPoolCreateInfo pool_info{};
  pool_info.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO;
  pool_info.flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
  pool_info.queueFamilyIndex = family;
  GIMLET_VK_CALL(vkCreateCommandPool(device_, &pool_info, nullptr, &command_pool_));
  VkCommandBufferAllocateInfo alloc_info{};
  alloc_info.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO;
  alloc_info.commandPool = command_pool_;
  alloc_info.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
  alloc_info.commandBufferCount = 1;
  GIMLET_VK_CALL(vkAllocateCommandBuffers(device_, &alloc_info, &command_buffer_));

  VkDescriptorPoolSize pool_size{VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, kBuffersPerPool};
  VkDescriptorPoolCreateInfo descriptor_info{};
  descriptor_info.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO;
  descriptor_info.maxSets = kDescriptorSetsPerPool;
  descriptor_info.poolSizeCount = 1;
  descriptor_info.pPoolSizes = &pool_size;
  GIMLET_VK_CALL(vkCreateDescriptorPool(device_, &descriptor_info, nullptr, &descriptor_pool_));

  VkFenceCreateInfo fence_info{};
  fence_info.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO;
  GIMLET_VK_CALL(vkCreateFence(device_, &fence_info, nullptr, &fence_));
}

void VulkanDevice::ReadLimits(VkPhysicalDevice physical) {
  VkPhysicalDeviceSubgroupProperties subgroup{};
  subgroup.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES;
  VkPhysicalDeviceProperties2 props{};
  props.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2;
  props.pNext = &subgroup;
  vkGetPhysicalDeviceProperties2(physical, &props);
  const VkPhysicalDeviceLimits& l = props.properties.limits;
  limits_.name = props.properties.deviceName;
  limits_.kind = DeviceKindName(props.properties.deviceType);
  limits_.api_version = props.properties.apiVersion;
  limits_.driver_version = props.properties.driverVersion;
  for (int i = 0; i < 3; ++i) {
    limits_.max_workgroup_size[i] = l.maxComputeWorkGroupSize[i];
    limits_.max_workgroup_count[i] = l.maxComputeWorkGroupCount[i];
  }
  limits_.max_workgroup_invocations = l.maxComputeWorkGroupInvocations;
  limits_.max_shared_memory = l.maxComputeSharedMemorySize;
  limits_.max_push_constants = l.maxPushConstantsSize;
  limits_.max_storage_buffers = l.maxPerStageDescriptorStorageBuffers;
  limits_.max_storage_buffer_range = l.maxStorageBufferRange;
  limits_.subgroup_size = subgroup.subgroupSize ? subgroup.subgroupSize : 1;

  VkPhysicalDeviceVulkan12Features features12{};
  features12.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES;
  VkPhysicalDeviceFeatures2 features{};
  features.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2;
  if (limits_.api_version >= VK_API_VERSION_1_2) features.pNext = &features12;
  vkGetPhysicalDeviceFeatures2(physical, &features);
  limits_.int64 = features.features.shaderInt64;
  limits_.float64 = features.features.shaderFloat64;
  limits_.int8_storage = features12.storageBuffer8BitAccess && features12.shaderInt8;

  VkPhysicalDeviceMemoryProperties memory{};
  vkGetPhysicalDeviceMemoryProperties(physical, &memory);
  for (uint32_t i = 0; i < memory.memoryHeapCount; ++i) {
    if (memory.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) {
      limits_.device_local_bytes += memory.memoryHeaps[i].size;
    }
  }
}

VulkanBuffer* VulkanDevice::Allocate(size_t nbytes) {
  // Vulkan has no empty buffers; zero-element tensors still get a small allocation.
  const size_t size = std::max<size_t>(nbytes, 16);
  auto buffer = std::make_unique<VulkanBuffer>();
  buffer->size = nbytes;
  buffer->device_id = device_id_;
  VkBufferCreateInfo info{};
  info.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO;
  info.size = size;
  info.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
               VK_BUFFER_USAGE_TRANSFER_DST_BIT;
  info.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  GIMLET_VK_CALL(vkCreateBuffer(device_, &info, nullptr, &buffer->buffer));
  VkMemoryRequirements requirements;
  vkGetBufferMemoryRequirements(device_, buffer->buffer, &requirements);
  if (!(requirements.memoryTypeBits & (1u << memory_type_))) {
    vkDestroyBuffer(device_, buffer->buffer, nullptr);
    TVM_FFI_THROW(RuntimeError) << "Vulkan device '" << limits_.name
                                << "': storage buffers cannot live in host-visible memory";
  }
  VkMemoryAllocateInfo alloc{};
  alloc.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO;
  alloc.allocationSize = requirements.size;
  alloc.memoryTypeIndex = memory_type_;
  VkResult result = vkAllocateMemory(device_, &alloc, nullptr, &buffer->memory);
  if (result != VK_SUCCESS) {
    vkDestroyBuffer(device_, buffer->buffer, nullptr);
    TVM_FFI_THROW(RuntimeError) << "Vulkan device '" << limits_.name << "': allocating "
                                << nbytes << " bytes failed (" << ResultName(result) << ")";
  }
  GIMLET_VK_CALL(vkBindBufferMemory(device_, buffer->buffer, buffer->memory, 0));
  GIMLET_VK_CALL(vkMapMemory(device_, buffer->memory, 0, VK_WHOLE_SIZE, 0, &buffer->host));
  return buffer.release();
}

void VulkanDevice::Release(VulkanBuffer* buffer) {
  vkDestroyBuffer(device_, buffer->buffer, nullptr);
  vkFreeMemory(device_, buffer->memory, nullptr);  // also unmaps
  delete buffer;
}

void VulkanDevice::Free(VulkanBuffer* buffer) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  // The VM frees intermediates as soon as the last kernel using them is *recorded*; the
  // buffer must outlive the submission, so it is released at the next flush.
  if (recording_) {
    deferred_frees_.push_back(buffer);
  } else {
    Release(buffer);
  }
}

VkCommandBuffer VulkanDevice::Record(VkDescriptorSetLayout layout, VkDescriptorSet* set) {
  VkDescriptorSetAllocateInfo info{};
  info.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO;
  info.descriptorPool = descriptor_pool_;
  info.descriptorSetCount = 1;
  info.pSetLayouts = &layout;
  VkResult result = vkAllocateDescriptorSets(device_, &info, set);
  if (result == VK_ERROR_OUT_OF_POOL_MEMORY || result == VK_ERROR_FRAGMENTED_POOL) {
    Flush();  // every set in the pool belongs to finished work now; the flush resets the pool
    result = vkAllocateDescriptorSets(device_, &info, set);
  }
  CheckVk(result, "vkAllocateDescriptorSets");
  if (!recording_) {
    VkCommandBufferBeginInfo begin{};
    begin.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO;
    begin.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
    GIMLET_VK_CALL(vkBeginCommandBuffer(command_buffer_, &begin));
    recording_ = true;
  }
  return command_buffer_;
}

void VulkanDevice::Flush() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (recording_) {
    recording_ = false;
    GIMLET_VK_CALL(vkEndCommandBuffer(command_buffer_));
    VkSubmitInfo submit{};
    submit.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO;
    submit.commandBufferCount = 1;
    submit.pCommandBuffers = &command_buffer_;
    GIMLET_VK_CALL(vkQueueSubmit(queue_, 1, &submit, fence_));
    GIMLET_VK_CALL(vkWaitForFences(device_, 1, &fence_, VK_TRUE, UINT64_MAX));
    GIMLET_VK_CALL(vkResetFences(device_, 1, &fence_));
    GIMLET_VK_CALL(vkResetCommandBuffer(command_buffer_, 0));
  }
  GIMLET_VK_CALL(vkResetDescriptorPool(device_, descriptor_pool_, 0));
  for (VulkanBuffer* buffer : deferred_frees_) Release(buffer);
  deferred_frees_.clear();
}

// ---------------------------------------------------------------------------------------------
// VulkanContext

VulkanContext& VulkanContext::Global() {
  // Never destroyed: modules and tensors may be released during interpreter shutdown.
  static VulkanContext* context = new VulkanContext();
  return *context;
}

VulkanContext::VulkanContext() {
  VkApplicationInfo app{};
  app.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO;
  app.pApplicationName = "gimlet-tvm";
  app.apiVersion = VK_API_VERSION_1_2;
  VkInstanceCreateInfo info{};
  info.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO;
  info.pApplicationInfo = &app;
  VkResult result = vkCreateInstance(&info, nullptr, &instance_);
  if (result != VK_SUCCESS) {
    error_ = std::string("cannot create a Vulkan instance (") + ResultName(result) +
             "): no Vulkan driver found (Debian: mesa-vulkan-drivers for lavapipe; check "
             "VK_ICD_FILENAMES)";
    instance_ = VK_NULL_HANDLE;
    return;
  }
  uint32_t count = 0;
  vkEnumeratePhysicalDevices(instance_, &count, nullptr);
  std::vector<VkPhysicalDevice> physical(count);
  vkEnumeratePhysicalDevices(instance_, &count, physical.data());
  if (count == 0) {
    error_ = "the Vulkan loader found no physical device (Debian: mesa-vulkan-drivers)";
    return;
  }
  for (uint32_t i = 0; i < count; ++i) {
    try {
      devices_.push_back(std::make_unique<VulkanDevice>(instance_, physical[i], i));
    } catch (const tvm::ffi::Error& err) {
      error_ = std::string("cannot open Vulkan device ") + std::to_string(i) + ": " + err.what();
      break;  // keep device ids dense: devices after a broken one are not offered
    }
  }
}

VulkanDevice& VulkanContext::device(int id) {
  if (id < 0 || static_cast<size_t>(id) >= devices_.size()) {
    TVM_FFI_THROW(RuntimeError) << "no Vulkan device " << id << ": "
                                << (error_.empty() ? std::to_string(devices_.size()) +
                                                         " device(s) present"
                                                   : error_);
  }
  return *devices_[id];
}

// ---------------------------------------------------------------------------------------------
// DeviceAPI

namespace {

using tvm::runtime::DeviceAttrKind;

class VulkanDeviceAPI final : public tvm::runtime::DeviceAPI {
 public:
  static VulkanDeviceAPI* Global() {
    static auto* api = new VulkanDeviceAPI();
    return api;
  }

  // Kernels always run on the device their buffers live on; nothing to select.
  void SetDevice(tvm::Device dev) final {}

  void GetAttr(tvm::Device dev, DeviceAttrKind kind, tvm::ffi::Any* rv) final {
    VulkanContext& context = VulkanContext::Global();
    if (kind == tvm::runtime::kExist) {
      *rv = static_cast<int64_t>(dev.device_id >= 0 &&
                                 static_cast<size_t>(dev.device_id) < context.num_devices());
      return;
    }
    if (static_cast<size_t>(dev.device_id) >= context.num_devices()) return;
    const DeviceLimits& l = context.device(dev.device_id).limits();
    switch (kind) {
      case tvm::runtime::kMaxThreadsPerBlock:
        *rv = static_cast<int64_t>(l.max_workgroup_invocations);
        break;
      case tvm::runtime::kWarpSize:
        *rv = static_cast<int64_t>(l.subgroup_size);
        break;
      case tvm::runtime::kMaxSharedMemoryPerBlock:
        *rv = static_cast<int64_t>(l.max_shared_memory);
        break;
      case tvm::runtime::kComputeVersion:
        *rv = tvm::ffi::String(VersionString(l.api_version));
        break;
      case tvm::runtime::kDeviceName:
        *rv = tvm::ffi::String(l.name);
        break;
      case tvm::runtime::kMaxThreadDimensions: {
        std::ostringstream os;
        os << "[" << l.max_workgroup_size[0] << ", " << l.max_workgroup_size[1] << ", "
           << l.max_workgroup_size[2] << "]";
        *rv = tvm::ffi::String(os.str());
        break;
      }
      case tvm::runtime::kApiVersion:
        *rv = static_cast<int64_t>(l.api_version);
        break;
      case tvm::runtime::kDriverVersion:
        *rv = static_cast<int64_t>(l.driver_version);
        break;
      case tvm::runtime::kTotalGlobalMemory:
        *rv = static_cast<int64_t>(l.device_local_bytes);
        break;
      default:
        break;  // not known for Vulkan devices: None
    }
  }

  void* AllocDataSpace(tvm::Device dev, size_t nbytes, size_t alignment,
                       DLDataType type_hint) final {
    return VulkanContext::Global().device(dev.device_id).Allocate(nbytes);
  }

  void FreeDataSpace(tvm::Device dev, void* ptr) final {
    auto* buffer = static_cast<VulkanBuffer*>(ptr);
    VulkanContext::Global().device(buffer->device_id).Free(buffer);
  }

  void StreamSync(tvm::Device dev, TVMStreamHandle stream) final {
    VulkanContext::Global().device(dev.device_id).Flush();
  }

 protected:
  void CopyDataFromTo(const void* from, size_t from_offset, void* to, size_t to_offset,
                      size_t size, tvm::Device dev_from, tvm::Device dev_to,
                      DLDataType type_hint, TVMStreamHandle stream) final {
    // Every Vulkan buffer is mapped: finish the queued kernels that may read or write it,
    // then copy on the host.
    const char* src = static_cast<const char*>(from);
    char* dst = static_cast<char*>(to);
    if (dev_from.device_type == kDLVulkan) {
      auto* buffer = static_cast<const VulkanBuffer*>(from);
      VulkanContext::Global().device(buffer->device_id).Flush();
      src = static_cast<const char*>(buffer->host);
    }
    if (dev_to.device_type == kDLVulkan) {
      auto* buffer = static_cast<VulkanBuffer*>(to);
      VulkanContext::Global().device(buffer->device_id).Flush();
      dst = static_cast<char*>(buffer->host);
    }
    if (size > 0) std::memcpy(dst + to_offset, src + from_offset, size);
  }
};

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def_packed("device_api.vulkan",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
                    *rv = static_cast<void*>(VulkanDeviceAPI::Global());
                  })
      // Devices and their limits as JSON, or {"error": why there are none}.
      .def("gimlet.vulkan.devices", []() -> tvm::ffi::String {
        VulkanContext& context = VulkanContext::Global();
        tvm::ffi::json::Array devices;
        for (size_t i = 0; i < context.num_devices(); ++i) {
          const DeviceLimits& l = context.device(static_cast<int>(i)).limits();
          tvm::ffi::json::Object d;
          d.Set(tvm::ffi::String("name"), tvm::ffi::String(l.name));
          d.Set(tvm::ffi::String("kind"), tvm::ffi::String(l.kind));
          d.Set(tvm::ffi::String("api_version"), tvm::ffi::String(VersionString(l.api_version)));
          d.Set(tvm::ffi::String("max_workgroup_invocations"),
                static_cast<int64_t>(l.max_workgroup_invocations));
          d.Set(tvm::ffi::String("max_workgroup_size"),
                tvm::ffi::json::Array{static_cast<int64_t>(l.max_workgroup_size[0]),
                                      static_cast<int64_t>(l.max_workgroup_size[1]),
                                      static_cast<int64_t>(l.max_workgroup_size[2])});
          d.Set(tvm::ffi::String("max_shared_memory"), static_cast<int64_t>(l.max_shared_memory));
          d.Set(tvm::ffi::String("max_push_constants"),
                static_cast<int64_t>(l.max_push_constants));
          d.Set(tvm::ffi::String("max_storage_buffers"),
                static_cast<int64_t>(l.max_storage_buffers));
          d.Set(tvm::ffi::String("max_storage_buffer_range"),
                static_cast<int64_t>(l.max_storage_buffer_range));
          d.Set(tvm::ffi::String("subgroup_size"), static_cast<int64_t>(l.subgroup_size));
          d.Set(tvm::ffi::String("int64"), l.int64);
          d.Set(tvm::ffi::String("float64"), l.float64);
          d.Set(tvm::ffi::String("int8_storage"), l.int8_storage);
          devices.push_back(d);
        }
        tvm::ffi::json::Object result;
        result.Set(tvm::ffi::String("devices"), devices);
        if (!context.error().empty()) {
          result.Set(tvm::ffi::String("error"), tvm::ffi::String(context.error()));
        }
        return tvm::ffi::json::Stringify(result);
      });
}

}  // namespace vulkan
}  // namespace gimlet
