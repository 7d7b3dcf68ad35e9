// Precompiled header of the sources that use tensors but not LibTorch's C++ front end
// (torch::nn, c10d, TorchScript): loading it costs a third of src/pch.h's (CMakeLists.txt).
#pragma once
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <toml++/toml.h>
#include <nlohmann/json.hpp>
