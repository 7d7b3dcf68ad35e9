// Precompiled header: the heavy third-party headers every Caravan translation unit uses.
#pragma once
#include <torch/torch.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <toml++/toml.h>
