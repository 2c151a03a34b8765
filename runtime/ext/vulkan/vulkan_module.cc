/*!
 * \file vulkan_module.cc
 * \brief The runtime module of a Vulkan build: SPIR-V compute shaders, launched by name.
 *
 * Kernel calling convention (what the GLSL printer in targets/vulkan_codegen.py emits and what
 * TVM's host code passes, in this order):
 *   - one storage buffer per buffer argument, binding i of descriptor set 0 (the `void*` TVM
 *     passes is a `VulkanBuffer*`);
 *   - scalar arguments as push constants, 8 bytes each, in argument order, followed by the
 *     logical grid as three uint32 push constants (x extent, y extent, total workgroups);
 *   - the launch parameters (grid and workgroup extents), named by `launch_params`.
 * The workgroup size is compiled into the shader; the launch checks TVM agrees with it.
 * The grid is dispatched folded (`FoldGrid`): each workgroup recovers its blockIdx from its
 * linear index, so grids larger than maxComputeWorkGroupCount[0] (65535) still launch.
 *
 * Serialized form (`SaveToBytes`): "GIMLETVK", then the JSON module description as a
 * length-prefixed string, then one length-prefixed SPIR-V blob per kernel, in JSON order.
 */
#include <tvm/ffi/cast.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>
#include <unordered_map>

#include "vulkan_device.h"

namespace gimlet {
namespace vulkan {

namespace {

namespace ffi = tvm::ffi;

constexpr char kMagic[] = "GIMLETVK";
constexpr size_t kScalarSlot = 8;  // bytes of push-constant space per scalar argument
constexpr size_t kGridBytes = 3 * sizeof(uint32_t);  // grid x, grid y, total workgroups

size_t PushConstantBytes(size_t num_scalars) { return num_scalars * kScalarSlot + kGridBytes; }

enum class ScalarKind { kInt64, kInt32, kUInt32, kFloat32, kFloat64, kBool };

ScalarKind ParseScalarKind(const std::string& dtype, const std::string& kernel) {
  if (dtype == "int64") return ScalarKind::kInt64;
  if (dtype == "int32") return ScalarKind::kInt32;
  if (dtype == "uint32") return ScalarKind::kUInt32;
  if (dtype == "float32") return ScalarKind::kFloat32;
  if (dtype == "float64") return ScalarKind::kFloat64;
  if (dtype == "bool") return ScalarKind::kBool;
  TVM_FFI_THROW(ValueError) << "Vulkan kernel '" << kernel << "': unsupported scalar argument type "
                            << dtype;
  TVM_FFI_UNREACHABLE();
}

/*! \brief What the launcher needs to know about one kernel (from the code generator). */
struct KernelInfo {
  std::string name;
  size_t num_buffers{0};
  std::vector<ScalarKind> scalars;
  std::vector<std::string> launch_params;
  std::array<uint32_t, 3> workgroup{1, 1, 1};
  uint32_t shared_bytes{0};
  ffi::Bytes spirv;
};

/*! \brief A kernel's Vulkan objects on one device. */
struct Pipeline {
  VkShaderModule shader{VK_NULL_HANDLE};
  VkDescriptorSetLayout set_layout{VK_NULL_HANDLE};
  VkPipelineLayout layout{VK_NULL_HANDLE};
  VkPipeline pipeline{VK_NULL_HANDLE};
};

int64_t GetInt(const ffi::json::Object& obj, const char* key) {
  return obj.at(ffi::String(key)).cast<int64_t>();
}

void AppendU64(std::string* out, uint64_t value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(value));
}

class VulkanModuleObj : public ffi::ModuleObj {
 public:
  VulkanModuleObj(std::vector<KernelInfo> kernels, std::string description)
      : kernels_(std::move(kernels)), description_(std::move(description)) {
    for (size_t i = 0; i < kernels_.size(); ++i) index_[kernels_[i].name] = i;
  }

  ~VulkanModuleObj() {
    for (auto& [key, pipeline] : pipelines_) {
      VkDevice device = VulkanContext::Global().device(key.first).handle();
      vkDestroyPipeline(device, pipeline.pipeline, nullptr);
      vkDestroyPipelineLayout(device, pipeline.layout, nullptr);
      vkDestroyDescriptorSetLayout(device, pipeline.set_layout, nullptr);
      vkDestroyShaderModule(device, pipeline.shader, nullptr);
    }
  }

  const char* kind() const final { return "vulkan"; }

  int GetPropertyMask() const final {
    return ffi::Module::kBinarySerializable | ffi::Module::kRunnable;
  }

  ffi::Optional<ffi::Function> GetFunction(const ffi::String& name) final {
    auto it = index_.find(std::string(name));
    if (it == index_.end()) return std::nullopt;
    ffi::ObjectPtr<ffi::Object> self = ffi::GetObjectPtr<ffi::Object>(this);
    size_t index = it->second;
    return ffi::Function::FromPacked([self, this, index](ffi::PackedArgs args, ffi::Any* rv) {
      Launch(kernels_[index], args);
    });
  }

  ffi::Bytes SaveToBytes() const final {
    std::string out(kMagic, sizeof(kMagic) - 1);
    AppendU64(&out, description_.size());
    out += description_;
    for (const KernelInfo& kernel : kernels_) {
      AppendU64(&out, kernel.spirv.size());
      out.append(kernel.spirv.data(), kernel.spirv.size());
    }
    return ffi::Bytes(out.data(), out.size());
  }

  /*! \brief Each kernel's SPIR-V, by name (what the code check validates). */
  ffi::Map<ffi::String, ffi::Bytes> Spirv() const {
    ffi::Map<ffi::String, ffi::Bytes> result;
    for (const KernelInfo& kernel : kernels_) result.Set(kernel.name, kernel.spirv);
    return result;
  }

  /*! \brief `format` "glsl" (or empty): the GLSL the shaders were compiled from. */
  ffi::String InspectSource(const ffi::String& format) const final {
    ffi::json::Object description = ffi::json::Parse(description_).cast<ffi::json::Object>();
    return description.at(ffi::String("source")).cast<ffi::String>();
  }

 private:
  /*! \brief The pipeline of `kernel` on device `device_id`, created (and checked against the
   * device's limits) on first use. */
  const Pipeline& GetPipeline(const KernelInfo& kernel, int device_id) {
    auto key = std::make_pair(device_id, kernel.name);
    auto found = pipelines_.find(key);
    if (found != pipelines_.end()) return found->second;
    VulkanDevice& device = VulkanContext::Global().device(device_id);
    CheckLimits(kernel, device.limits());
    VkDevice vk = device.handle();
    Pipeline p;

    VkShaderModuleCreateInfo shader_info{};
    shader_info.sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO;
    shader_info.codeSize = kernel.spirv.size();
    shader_info.pCode = reinterpret_cast<const uint32_t*>(kernel.spirv.data());
    GIMLET_VK_CALL(vkCreateShaderModule(vk, &shader_info, nullptr, &p.shader));

    std::vector<VkDescriptorSetLayoutBinding> bindings(kernel.num_buffers);
    for (size_t i = 0; i < kernel.num_buffers; ++i) {
      bindings[i].binding = static_cast<uint32_t>(i);
      bindings[i].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
      bindings[i].descriptorCount = 1;
      bindings[i].stageFlags = VK_SHADER_STAGE_COMPUTE_BIT;
    }
    VkDescriptorSetLayoutCreateInfo set_info{};
    set_info.sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO;
    set_info.bindingCount = static_cast<uint32_t>(bindings.size());
    set_info.pBindings = bindings.data();
    GIMLET_VK_CALL(vkCreateDescriptorSetLayout(vk, &set_info, nullptr, &p.set_layout));

    VkPushConstantRange push{VK_SHADER_STAGE_COMPUTE_BIT, 0,
                             static_cast<uint32_t>(PushConstantBytes(kernel.scalars.size()))};
    VkPipelineLayoutCreateInfo layout_info{};
    layout_info.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO;
    layout_info.setLayoutCount = 1;
    layout_info.pSetLayouts = &p.set_layout;
    layout_info.pushConstantRangeCount = 1;
    layout_info.pPushConstantRanges = &push;
    GIMLET_VK_CALL(vkCreatePipelineLayout(vk, &layout_info, nullptr, &p.layout));

    VkComputePipelineCreateInfo pipeline_info{};
    pipeline_info.sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO;
    pipeline_info.stage.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO;
    pipeline_info.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
    pipeline_info.stage.module = p.shader;
    pipeline_info.stage.pName = "main";
    pipeline_info.layout = p.layout;
    VkResult result =
        vkCreateComputePipelines(vk, VK_NULL_HANDLE, 1, &pipeline_info, nullptr, &p.pipeline);
    if (result != VK_SUCCESS) {
      TVM_FFI_THROW(RuntimeError) << "Vulkan kernel '" << kernel.name
                                  << "': creating its compute pipeline failed (" << result << ")";
    }
    return pipelines_.emplace(key, p).first->second;
  }

  static void CheckLimits(const KernelInfo& kernel, const DeviceLimits& l) {
    std::ostringstream why;
    const auto& wg = kernel.workgroup;
    uint64_t invocations = uint64_t{wg[0]} * wg[1] * wg[2];
    if (invocations > l.max_workgroup_invocations) {
      why << "a workgroup of " << invocations << " invocations (" << wg[0] << "x" << wg[1] << "x"
          << wg[2] << "), the device allows " << l.max_workgroup_invocations
          << " (maxComputeWorkGroupInvocations)";
    }
    for (int i = 0; i < 3 && why.tellp() == 0; ++i) {
      if (wg[i] > l.max_workgroup_size[i]) {
        why << "workgroup size " << wg[i] << " in dimension " << i << ", the device allows "
            << l.max_workgroup_size[i] << " (maxComputeWorkGroupSize)";
      }
    }
    if (why.tellp() == 0 && kernel.shared_bytes > l.max_shared_memory) {
      why << kernel.shared_bytes << " bytes of shared memory, the device allows "
          << l.max_shared_memory << " (maxComputeSharedMemorySize)";
    }
    if (why.tellp() == 0 && PushConstantBytes(kernel.scalars.size()) > l.max_push_constants) {
      why << kernel.scalars.size() << " scalar arguments ("
          << PushConstantBytes(kernel.scalars.size())
          << " bytes of push constants), the device allows " << l.max_push_constants;
    }
    if (why.tellp() == 0 && kernel.num_buffers > l.max_storage_buffers) {
      why << kernel.num_buffers << " storage buffers, the device allows "
          << l.max_storage_buffers << " (maxPerStageDescriptorStorageBuffers)";
    }
    if (why.tellp() != 0) {
      TVM_FFI_THROW(RuntimeError) << "Vulkan kernel '" << kernel.name << "' exceeds the limits of "
                                  << "device '" << l.name << "': it needs " << why.str();
    }
  }

  void Launch(const KernelInfo& kernel, ffi::PackedArgs args) {
    const size_t num_scalars = kernel.scalars.size();
    const size_t expected = kernel.num_buffers + num_scalars + kernel.launch_params.size();
    TVM_FFI_ICHECK_EQ(static_cast<size_t>(args.size()), expected)
        << "Vulkan kernel '" << kernel.name << "': wrong number of arguments";

    std::vector<VulkanBuffer*> buffers(kernel.num_buffers);
    for (size_t i = 0; i < kernel.num_buffers; ++i) {
      buffers[i] = static_cast<VulkanBuffer*>(args[i].cast<void*>());
    }
    // Scalars: one 8-byte push-constant slot each (see the printer's push-constant block).
    std::vector<char> push(PushConstantBytes(num_scalars), 0);
    for (size_t i = 0; i < num_scalars; ++i) {
      char* slot = push.data() + i * kScalarSlot;
      ffi::AnyView arg = args[kernel.num_buffers + i];
      switch (kernel.scalars[i]) {
        case ScalarKind::kInt64: {
          int64_t v = arg.cast<int64_t>();
          std::memcpy(slot, &v, sizeof(v));
          break;
        }
        case ScalarKind::kInt32:
        case ScalarKind::kUInt32:
        case ScalarKind::kBool: {
          int32_t v = static_cast<int32_t>(arg.cast<int64_t>());
          std::memcpy(slot, &v, sizeof(v));
          break;
        }
        case ScalarKind::kFloat32: {
          float v = static_cast<float>(arg.cast<double>());
          std::memcpy(slot, &v, sizeof(v));
          break;
        }
        case ScalarKind::kFloat64: {
          double v = arg.cast<double>();
          std::memcpy(slot, &v, sizeof(v));
          break;
        }
      }
    }
    uint64_t grid[3] = {1, 1, 1};
    uint64_t block[3] = {1, 1, 1};
    for (size_t i = 0; i < kernel.launch_params.size(); ++i) {
      const std::string& tag = kernel.launch_params[i];
      int64_t extent = args[kernel.num_buffers + num_scalars + i].cast<int64_t>();
      int dim = tag.back() - 'x';
      if (tag.rfind("blockIdx.", 0) == 0) {
        grid[dim] = extent;
      } else if (tag.rfind("threadIdx.", 0) == 0) {
        block[dim] = extent;
      }
    }

    int device_id = buffers.empty() ? 0 : buffers[0]->device_id;
    VulkanDevice& device = VulkanContext::Global().device(device_id);
    std::lock_guard<std::recursive_mutex> lock(device.mutex());
    const Pipeline& pipeline = GetPipeline(kernel, device_id);
    const DeviceLimits& limits = device.limits();
    for (int d = 0; d < 3; ++d) {
      if (block[d] != kernel.workgroup[d]) {
        TVM_FFI_THROW(RuntimeError) << "Vulkan kernel '" << kernel.name << "': launched with "
                                    << block[d] << " threads in dimension " << d
                                    << ", but compiled for " << kernel.workgroup[d];
      }
    }
    const uint64_t total = grid[0] * grid[1] * grid[2];
    if (total == 0) return;  // empty tensors: nothing to compute
    // Fold the grid into x, then y, then z, each within the device's workgroup count limit.
    const auto& max_count = limits.max_workgroup_count;
    uint64_t dispatch[3];
    dispatch[0] = std::min<uint64_t>(total, max_count[0]);
    uint64_t rest = (total + dispatch[0] - 1) / dispatch[0];
    dispatch[1] = std::min<uint64_t>(rest, max_count[1]);
    dispatch[2] = (rest + dispatch[1] - 1) / dispatch[1];
    if (total > UINT32_MAX || dispatch[2] > max_count[2]) {
      TVM_FFI_THROW(RuntimeError) << "Vulkan kernel '" << kernel.name
                                  << "' exceeds the limits of device '" << limits.name
                                  << "': it launches " << total
                                  << " workgroups (maxComputeWorkGroupCount)";
    }
    const uint32_t grid_push[3] = {static_cast<uint32_t>(grid[0]),
                                   static_cast<uint32_t>(grid[1]),
                                   static_cast<uint32_t>(total)};
    std::memcpy(push.data() + num_scalars * kScalarSlot, grid_push, sizeof(grid_push));

    std::vector<VkDescriptorBufferInfo> infos(kernel.num_buffers);
    std::vector<VkWriteDescriptorSet> writes(kernel.num_buffers);
    VkDescriptorSet set;
    VkCommandBuffer cmd = device.Record(pipeline.set_layout, &set);
    for (size_t i = 0; i < kernel.num_buffers; ++i) {
      TVM_FFI_ICHECK_EQ(buffers[i]->device_id, device_id)
          << "Vulkan kernel '" << kernel.name << "': arguments on different devices";
      if (buffers[i]->size > limits.max_storage_buffer_range) {
        TVM_FFI_THROW(RuntimeError)
            << "Vulkan kernel '" << kernel.name << "' exceeds the limits of device '"
            << limits.name << "': buffer argument " << i << " has " << buffers[i]->size
            << " bytes, the device binds at most " << limits.max_storage_buffer_range
            << " (maxStorageBufferRange)";
      }
      infos[i] = {buffers[i]->buffer, 0, VK_WHOLE_SIZE};
      writes[i].sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET;
      writes[i].dstSet = set;
      writes[i].dstBinding = static_cast<uint32_t>(i);
      writes[i].descriptorCount = 1;
      writes[i].descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
      writes[i].pBufferInfo = &infos[i];
    }
    vkUpdateDescriptorSets(device.handle(), static_cast<uint32_t>(writes.size()), writes.data(), 0,
                           nullptr);
    vkCmdBindPipeline(cmd, VK_PIPELINE_BIND_POINT_COMPUTE, pipeline.pipeline);
    vkCmdBindDescriptorSets(cmd, VK_PIPELINE_BIND_POINT_COMPUTE, pipeline.layout, 0, 1, &set, 0,
                            nullptr);
    vkCmdPushConstants(cmd, pipeline.layout, VK_SHADER_STAGE_COMPUTE_BIT, 0,
                       static_cast<uint32_t>(push.size()), push.data());
    vkCmdDispatch(cmd, static_cast<uint32_t>(dispatch[0]), static_cast<uint32_t>(dispatch[1]),
                  static_cast<uint32_t>(dispatch[2]));
    // Kernels run in recording order only with a barrier: make this dispatch's writes visible
    // to the next dispatch's reads (and order its reads before the next one's writes).
    VkMemoryBarrier barrier{};
    barrier.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER;
    barrier.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_SHADER_READ_BIT;
    barrier.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT |
                            VK_ACCESS_HOST_READ_BIT;
    vkCmdPipelineBarrier(cmd, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                         VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                         &barrier, 0, nullptr, 0, nullptr);
  }

  std::vector<KernelInfo> kernels_;
  std::string description_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::pair<int, std::string>, Pipeline> pipelines_;
};

/*!
 * \brief Build the module from the code generator's JSON description
 * ({"kernels": [{name, num_buffers, scalars, launch_params, workgroup, shared_bytes}],
 *   "source": GLSL}) and one SPIR-V blob per kernel, in the same order.
 */
ffi::Module CreateModule(const std::string& description, std::vector<ffi::Bytes> blobs) {
  ffi::String error;
  ffi::json::Value parsed = ffi::json::Parse(description, &error);
  TVM_FFI_CHECK(error.empty(), ValueError) << "bad Vulkan module description: " << error;
  ffi::json::Array entries =
      parsed.cast<ffi::json::Object>().at(ffi::String("kernels")).cast<ffi::json::Array>();
  TVM_FFI_CHECK(entries.size() == blobs.size(), ValueError)
      << "Vulkan module: " << entries.size() << " kernels but " << blobs.size() << " SPIR-V blobs";
  std::vector<KernelInfo> kernels;
  for (size_t i = 0; i < entries.size(); ++i) {
    auto entry = entries[i].cast<ffi::json::Object>();
    KernelInfo k;
    k.name = entry.at(ffi::String("name")).cast<ffi::String>();
    k.num_buffers = static_cast<size_t>(GetInt(entry, "num_buffers"));
    for (const ffi::Any& s : entry.at(ffi::String("scalars")).cast<ffi::json::Array>()) {
      k.scalars.push_back(ParseScalarKind(s.cast<ffi::String>(), k.name));
    }
    for (const ffi::Any& p : entry.at(ffi::String("launch_params")).cast<ffi::json::Array>()) {
      k.launch_params.push_back(p.cast<ffi::String>());
    }
    auto wg = entry.at(ffi::String("workgroup")).cast<ffi::json::Array>();
    for (int d = 0; d < 3; ++d) k.workgroup[d] = static_cast<uint32_t>(wg[d].cast<int64_t>());
    k.shared_bytes = static_cast<uint32_t>(GetInt(entry, "shared_bytes"));
    TVM_FFI_CHECK(blobs[i].size() % 4 == 0 && blobs[i].size() >= 20, ValueError)
        << "Vulkan kernel '" << k.name << "': not a SPIR-V module";
    k.spirv = blobs[i];
    kernels.push_back(std::move(k));
  }
  return ffi::Module(ffi::make_object<VulkanModuleObj>(std::move(kernels), description));
}

uint64_t ReadU64(const ffi::Bytes& bytes, size_t* pos) {
  TVM_FFI_CHECK(*pos + sizeof(uint64_t) <= bytes.size(), ValueError)
      << "truncated Vulkan module";
  uint64_t value;
  std::memcpy(&value, bytes.data() + *pos, sizeof(value));
  *pos += sizeof(value);
  return value;
}

std::string ReadChunk(const ffi::Bytes& bytes, size_t* pos) {
  uint64_t size = ReadU64(bytes, pos);
  TVM_FFI_CHECK(*pos + size <= bytes.size(), ValueError) << "truncated Vulkan module";
  std::string chunk(bytes.data() + *pos, size);
  *pos += size;
  return chunk;
}

ffi::Module LoadFromBytes(const ffi::Bytes& bytes) {
  const size_t magic = sizeof(kMagic) - 1;
  TVM_FFI_CHECK(bytes.size() >= magic && std::memcmp(bytes.data(), kMagic, magic) == 0, ValueError)
      << "not a gimlet Vulkan module";
  size_t pos = magic;
  std::string description = ReadChunk(bytes, &pos);
  ffi::json::Object parsed = ffi::json::Parse(description).cast<ffi::json::Object>();
  size_t count = parsed.at(ffi::String("kernels")).cast<ffi::json::Array>().size();
  std::vector<ffi::Bytes> blobs;
  for (size_t i = 0; i < count; ++i) {
    std::string blob = ReadChunk(bytes, &pos);
    blobs.emplace_back(blob.data(), blob.size());
  }
  return CreateModule(description, std::move(blobs));
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("gimlet.vulkan.module_create",
           [](ffi::String description, ffi::Array<ffi::Bytes> blobs) {
             return CreateModule(description, std::vector<ffi::Bytes>(blobs.begin(), blobs.end()));
           })
      .def("gimlet.vulkan.module_spirv",
           [](ffi::Module module) {
             TVM_FFI_CHECK(std::string(module->kind()) == "vulkan", ValueError)
                 << "not a Vulkan module: " << module->kind();
             return static_cast<const VulkanModuleObj*>(module.get())->Spirv();
           })
      .def("ffi.Module.load_from_bytes.vulkan", LoadFromBytes);
}

}  // namespace vulkan
}  // namespace gimlet
