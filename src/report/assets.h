// The files `caravan report` puts into its pages, embedded at build time (cmake/embed.cmake):
// report/report.js, report/report.css and Chart.js from report/node_modules (empty when npm
// had not installed it when this was built; report.cpp then says how to get it).
#pragma once

#include <string_view>

namespace caravan::report::assets {

std::string_view chartJs();
std::string_view reportJs();
std::string_view reportCss();

}  // namespace caravan::report::assets
