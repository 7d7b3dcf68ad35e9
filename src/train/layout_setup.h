// parallel.layout = auto in `caravan train`: the job laid out as the layout search chooses, the
// same on every rank. The search (sim/choose_layout.h, a layer above train/) comes in as a
// LayoutChooser: the CLI hands sim::chooseLayoutKeys to train() in TrainerOptions.
//
// Rank 0 waits until every rank has reached the job's store (so each has checked the run
// directory as it was), then searches on a profile of the model, for the world's workers (its
// size less the config's servers) on parallel.cluster's cluster (none: this machine, without the
// capacity check), and writes RUN_DIR/layout.json; a resumed run reads the layout.json it wrote
// instead of searching again. It hands the chosen keys to the other ranks through the store, or
// its refusal, which each rank then raises as its own (ConfigError, one line), or its failure
// (PeerError naming it), and waits (fault.rendezvous_timeout at most) until they have read it
// before its store goes. A rank waits for rank 0 at most kLayoutWait; rank 0 ending first ends
// the wait (a TCP store lives in rank 0). The keys live in the job's store as its rendezvous
// does: under caravan's launcher a file store (dist.store_path) is the start's own (comm/store.h,
// WorldInfo::start); under another launcher a file an earlier job left would hand its layout on
// as it would its rendezvous keys, so give each job a fresh one.
//
// Threading: the trainer's thread.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/world.h"
#include "core/config.h"

namespace c10d {
class Store;
}

namespace caravan {

inline constexpr std::chrono::minutes kLayoutWait{30};

// Rank 0's layout: the keys for `workers` workers (the world less the config's servers); writes
// `file` (RUN_DIR/layout.json), or on `resume` reads the one there. `log`: prints the chosen
// layout's line. Throws ConfigError (one line) for a job no layout fits.
using LayoutChooser = std::function<std::vector<std::string>(
    const Config& config, int workers, const std::string& file, bool resume, bool log)>;

bool layoutIsAuto(const Config& config);

// `config` with the chosen layout's keys applied over its own. `store`: the job's (null in a world
// of one). `choose`: rank 0's chooser (empty: ConfigError). `log`: rank 0 prints the chosen line.
Config resolveLayout(const Config& config, const WorldInfo& world, const std::string& runDir,
                     bool resume, c10d::Store* store, const LayoutChooser& choose, bool log);

}  // namespace caravan
