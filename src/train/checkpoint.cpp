// Trainer checkpoint files: writers, the validating reader, the primary-weight file and the HF
// export. The reader checks the whole directory before it returns anything.
#include "train/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "core/json_limits.h"
#include "io/atomic_file.h"
#include "io/checkpoint_dir.h"
#include "io/hf_weights.h"
#include "io/read_file.h"
#include "io/safetensors.h"
#include "train/train_config.h"

namespace packmoe::train {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kStateFormat = "packmoe-trainer-state";
constexpr int64_t kStateVersion = 3;
// Version 1 also held per-linear NVFP4 SR counters ("sr_offsets", and per shard); they are ignored:
// the trainer now derives every micro-batch's offset from the step (nvfp4_grad_sr_offset).
// Versions 1 and 2 read one unshuffled stream: "sampler" {offset, epoch, stream_tokens}, which
// is that source's sample count epoch x windows + offset / seq_len (and train.shuffle false).
constexpr int64_t kSamplerCountsVersion = 3;
constexpr int64_t kOldestStateVersion = 1;
constexpr int64_t kMaxWorldSize = int64_t{1} << 20;

std::string in_dir(const std::string& dir, const char* file) {
  return (fs::path(dir) / file).string();
}

// ---- trainer_state.json -------------------------------------------------------------------------

// "shard_plan": the saving job's layout and, per rank, its shard file.
json shard_plan_json(const TrainerCheckpoint& c) {
  const SavedShardPlan& plan = *c.shard_plan;
  const std::vector<ParamSpec> specs = model_param_specs(c.model);
  PACKMOE_CHECK(plan.params.size() == specs.size() && plan.offsets.size() == specs.size(),
                "a shard plan of " << plan.params.size() << " parameters for " << specs.size());
  PACKMOE_CHECK(static_cast<int64_t>(plan.shards.size()) == c.world_size,
                "a shard plan of " << plan.shards.size() << " ranks for world size " << c.world_size);
  json params = json::array();
  for (size_t p = 0; p < specs.size(); ++p) {
    const ParamGeometry& g = plan.params[p];
    params.push_back({{"name", specs[p].name},
                      {"experts", g.experts},
                      {"rows", g.rows},
                      {"cols", g.cols},
                      {"unit_rows", g.unit_rows},
                      {"offset", plan.offsets[p]}});
  }
  json shards = json::array();
  for (size_t r = 0; r < plan.shards.size(); ++r)
    shards.push_back(
        {{"rank", r},
         {"begin", plan.shards[r].begin},
         {"end", plan.shards[r].end},
         {"file", optimizer_shard_file(static_cast<int>(r), static_cast<int>(c.world_size))}});
  return {{"total", plan.total},
          {"bucket_elems", plan.bucket_elems},
          {"params", std::move(params)},
          {"shards", std::move(shards)}};
}

json state_json(const TrainerCheckpoint& c) {
  json j;
  j["format"] = kStateFormat;
  j["version"] = kStateVersion;
  j["step"] = c.step;
  j["optimizer_steps"] = c.optimizer_steps;
  PACKMOE_CHECK(c.sampler.consumed.size() == c.train_sources.size(),
                c.sampler.consumed.size() << " sample counts for " << c.train_sources.size()
                                          << " sources");
  json sources = json::array();
  for (const SourceShape& shape : c.train_sources) {
    json src = {{"tokens", shape.tokens}, {"windows", shape.windows}};
    if (shape.packed) src["packed"] = true;  // SFT rows (train/batch_sampler.h rows_of_packed)
    sources.push_back(std::move(src));
  }
  j["sampler"] = {{"consumed", c.sampler.consumed}, {"sources", std::move(sources)}};
  j["train"] = train_config_to_json(c.config);
  j["world_size"] = c.world_size;
  j["shard_plan"] = c.shard_plan ? shard_plan_json(c) : json(nullptr);
  return j;
}

// Field readers: every error is "PATH: <field> ...".
class StateReader {
 public:
  explicit StateReader(std::string path) : path_(std::move(path)) {}

  Status error(const std::string& what) const { return Status::error(path_ + ": " + what); }

  Status object(const json& j, const std::string& field) const {
    if (j.is_object()) return Status::ok();
    return error(field + " must be a JSON object (got " + json_brief(j) + ")");
  }
  const json* find(const json& j, const std::string& parent, const char* key, Status* s) const {
    auto it = j.find(key);
    if (it == j.end()) {
      *s = error("missing field " + parent + key);
      return nullptr;
    }
    return &*it;
  }
  Status int_at_least(const json& j, const std::string& parent, const char* key, int64_t lo,
                      int64_t* out) const {
    Status s;
    const json* v = find(j, parent, key, &s);
    if (!v) return s;
    const bool fits = v->is_number_integer() &&
                      !(v->is_number_unsigned() &&
                        v->get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()});
    if (!fits || v->get<int64_t>() < lo)
      return error(parent + key + " must be an integer >= " + std::to_string(lo) + " (got " +
                   json_brief(*v) + ")");
    *out = v->get<int64_t>();
    return Status::ok();
  }

 private:
  std::string path_;
};

// "shard_plan" (after world_size): null for a single process; else the saving job's plan, which
// must be one of this model's parameters (names in order, element counts) and cover the flat
// buffer with world_size consecutive shards, each with its file.
Status parse_shard_plan(const json& j, const StateReader& r, TrainerCheckpoint* c) {
  Status s;
  const json* plan = r.find(j, "", "shard_plan", &s);
  if (!plan) return s;
  c->shard_plan.reset();
  if (plan->is_null()) {
    if (c->world_size == 1) return Status::ok();
    return r.error("world_size " + std::to_string(c->world_size) +
                   " without a shard_plan: the optimizer shards are not described");
  }
  PACKMOE_RETURN_IF_ERROR(r.object(*plan, "shard_plan"));
  SavedShardPlan sp;
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(*plan, "shard_plan.", "total", 1, &sp.total));
  PACKMOE_RETURN_IF_ERROR(
      r.int_at_least(*plan, "shard_plan.", "bucket_elems", 1, &sp.bucket_elems));
  const std::vector<ParamSpec> specs = model_param_specs(c->model);
  const json* params = r.find(*plan, "shard_plan.", "params", &s);
  if (!params) return s;
  if (!params->is_array() || params->size() != specs.size())
    return r.error("shard_plan.params must be an array of " + std::to_string(specs.size()) +
                   " entries, one per parameter of the model (a plan of another model?)");
  for (size_t p = 0; p < specs.size(); ++p) {
    const json& e = (*params)[p];
    const std::string at = "shard_plan.params[" + std::to_string(p) + "].";
    PACKMOE_RETURN_IF_ERROR(r.object(e, at));
    if (!e.contains("name") || e["name"] != specs[p].name)
      return r.error(at + "name must be \"" + specs[p].name + "\" (got " +
                     (e.contains("name") ? json_brief(e["name"]) : std::string("none")) +
                     "): a plan of another model");
    ParamGeometry g;
    int64_t offset = 0;
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "experts", 1, &g.experts));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "rows", 1, &g.rows));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "cols", 1, &g.cols));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "unit_rows", 1, &g.unit_rows));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "offset", 0, &offset));
    const int64_t numel = shape_numel(specs[p].shape);
    const bool fits = g.experts <= numel && g.rows <= numel / g.experts &&
                      g.cols <= numel / (g.experts * g.rows);  // so E * N * K cannot overflow
    if (!fits || g.numel() != numel)
      return r.error("shard_plan.params[" + std::to_string(p) + "] (" + std::to_string(g.experts) +
                     ", " + std::to_string(g.rows) + ", " + std::to_string(g.cols) +
                     ") does not hold " + specs[p].name + " of shape " +
                     shape_string(specs[p].shape) + ": a plan of another model");
    if (g.rows % g.unit_rows != 0 || offset > sp.total - numel)
      return r.error(at + "unit_rows or offset out of range");
    sp.params.push_back(g);
    sp.offsets.push_back(offset);
  }
  const json* shards = r.find(*plan, "shard_plan.", "shards", &s);
  if (!shards) return s;
  if (!shards->is_array() || static_cast<int64_t>(shards->size()) != c->world_size)
    return r.error("shard_plan.shards must be an array of world_size = " +
                   std::to_string(c->world_size) + " entries, one per rank");
  int64_t next = 0;
  for (int64_t rank = 0; rank < c->world_size; ++rank) {
    const json& e = (*shards)[rank];
    const std::string at = "shard_plan.shards[" + std::to_string(rank) + "].";
    PACKMOE_RETURN_IF_ERROR(r.object(e, at));
    int64_t got_rank = 0;
    FlatRange range;
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "rank", 0, &got_rank));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "begin", 0, &range.begin));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least(e, at, "end", 0, &range.end));
    if (got_rank != rank || range.begin != next || range.end < range.begin || range.end > sp.total)
      return r.error(at +
                     "rank, begin or end out of order (the shards must cover [0, total) "
                     "in rank order)");
    next = range.end;
    const std::string file =
        optimizer_shard_file(static_cast<int>(rank), static_cast<int>(c->world_size));
    if (!e.contains("file") || e["file"] != file)
      return r.error(at + "file must be \"" + file + "\"");
    sp.shards.push_back(range);
  }
  if (next != sp.total)
    return r.error("shard_plan.shards end at " + std::to_string(next) +
                   ", not at total = " + std::to_string(sp.total));
  c->shard_plan = std::move(sp);
  return Status::ok();
}

// Versions 1 and 2: {offset, epoch, stream_tokens} of one unshuffled stream (train config read).
Status parse_legacy_sampler(const json& sampler, const StateReader& r, TrainerCheckpoint* c) {
  int64_t offset = 0, epoch = 0, tokens = 0;
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(sampler, "sampler.", "offset", 0, &offset));
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(sampler, "sampler.", "epoch", 0, &epoch));
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(sampler, "sampler.", "stream_tokens", 1, &tokens));
  const int64_t S = c->config.seq_len;
  if (tokens < S + 1 || offset % S != 0 || offset > tokens - S - 1)
    return r.error("sampler position (epoch " + std::to_string(epoch) + ", offset " +
                   std::to_string(offset) + ") is not a window start of a stream of " +
                   std::to_string(tokens) + " tokens at seq_len " + std::to_string(S));
  const int64_t windows = (tokens - S - 1) / S + 1;
  int64_t consumed = 0;
  if (__builtin_mul_overflow(epoch, windows, &consumed) ||
      __builtin_add_overflow(consumed, offset / S, &consumed))
    return r.error("sampler.epoch " + std::to_string(epoch) + " is out of range");
  c->sampler.consumed = {consumed};
  c->train_sources = {SourceShape{tokens, windows}};
  return Status::ok();
}

// Parses trainer_state.json into `c` (model already read: it checks the train config and the shard
// plan).
Status parse_state(const json& j, const std::string& path, int64_t marker_step,
                   TrainerCheckpoint* c) {
  const StateReader r(path);
  PACKMOE_RETURN_IF_ERROR(r.object(j, "the document"));
  if (!j.contains("format") || j["format"] != kStateFormat)
    return r.error(std::string("not a packmoe trainer state (\"format\" is not \"") + kStateFormat +
                   "\")");
  int64_t version = 0;
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(j, "", "version", 0, &version));
  if (version < kOldestStateVersion || version > kStateVersion)
    return r.error("version " + std::to_string(version) + " is not supported (this build reads " +
                   std::to_string(kOldestStateVersion) + " to " + std::to_string(kStateVersion) +
                   ")");
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(j, "", "step", 0, &c->step));
  if (c->step != marker_step)
    return r.error("step " + std::to_string(c->step) + " differs from the step " +
                   std::to_string(marker_step) + " of " + io::kCheckpointMarker);
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(j, "", "optimizer_steps", 0, &c->optimizer_steps));
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"step", c->step}, {"optimizer_steps", c->optimizer_steps}}) {
    const Status range = check_step_count(name, value);
    if (!range.is_ok()) return r.error(range.message());
  }
  PACKMOE_RETURN_IF_ERROR(r.int_at_least(j, "", "world_size", 1, &c->world_size));
  if (c->world_size > kMaxWorldSize)
    return r.error("world_size " + std::to_string(c->world_size) + " is out of range");

  PACKMOE_RETURN_IF_ERROR(parse_shard_plan(j, r, c));

  Status s;
  const json* train = r.find(j, "", "train", &s);
  if (!train) return s;
  TrainConfig config;
  Status applied = apply_train_json(*train, &config);
  if (version < kSamplerCountsVersion) config.shuffle = false;  // what those versions read
  if (applied.is_ok()) applied = validate(config, c->model);
  if (!applied) return r.error(applied.message());
  c->config = config;

  const json* sampler = r.find(j, "", "sampler", &s);
  if (!sampler) return s;
  PACKMOE_RETURN_IF_ERROR(r.object(*sampler, "sampler"));
  if (version < kSamplerCountsVersion) return parse_legacy_sampler(*sampler, r, c);
  const json* consumed = r.find(*sampler, "sampler.", "consumed", &s);
  if (!consumed) return s;
  const json* sources = r.find(*sampler, "sampler.", "sources", &s);
  if (!sources) return s;
  if (!consumed->is_array() || !sources->is_array() || consumed->size() != sources->size() ||
      consumed->empty() || consumed->size() > kMaxBlendSources)
    return r.error("sampler.consumed and sampler.sources must be arrays of one entry per data "
                   "source (got " + json_brief(*consumed) + " and " + json_brief(*sources) + ")");
  c->sampler.consumed.clear();
  c->train_sources.clear();
  for (size_t d = 0; d < consumed->size(); ++d) {
    const std::string at = "sampler.sources[" + std::to_string(d) + "].";
    const json& n = (*consumed)[d];
    if (!n.is_number_unsigned() || n.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()})
      return r.error("sampler.consumed[" + std::to_string(d) + "] must be an integer >= 0 (got " +
                     json_brief(n) + ")");
    c->sampler.consumed.push_back(n.get<int64_t>());
    PACKMOE_RETURN_IF_ERROR(r.object((*sources)[d], at));
    SourceShape shape;
    PACKMOE_RETURN_IF_ERROR(r.int_at_least((*sources)[d], at, "tokens", 2, &shape.tokens));
    PACKMOE_RETURN_IF_ERROR(r.int_at_least((*sources)[d], at, "windows", 1, &shape.windows));
    if (auto p = (*sources)[d].find("packed"); p != (*sources)[d].end()) {
      if (!p->is_boolean()) return r.error(at + "packed must be true or false");
      shape.packed = p->get<bool>();
    }
    const int64_t S = c->config.seq_len;
    // Packed rows hold 1 to S tokens each; windows are the exact count of the stream's.
    if (shape.packed ? shape.windows > shape.tokens || shape.windows < (shape.tokens + S - 1) / S
                     : shape.windows != (shape.tokens - 1 - S) / S + 1 || shape.tokens < S + 1)
      return r.error(at + "windows " + std::to_string(shape.windows) + " is not the sample count of " +
                     std::to_string(shape.tokens) + " tokens at seq_len " +
                     std::to_string(c->config.seq_len));
    c->train_sources.push_back(shape);
  }
  return Status::ok();
}

// ---- optimizer shards ---------------------------------------------------------------------------

Result<OptimizerShard> read_shard_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": missing (an optimizer shard the shard plan names)");
  const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in),
                                   std::istreambuf_iterator<char>()};
  Result<OptimizerShard> shard = decode_optimizer_shard(bytes);
  if (!shard) return Status::error(path + ": " + shard.status().message());
  return shard;
}

Tensor host_f32(const std::vector<float>& values, const Shape& shape) {
  Tensor t = Tensor::empty(cpu_backend(), DType::kF32, shape);
  PACKMOE_CHECK(t.nbytes() == values.size() * sizeof(float), "state of another size");
  std::memcpy(t.data(), values.data(), t.nbytes());
  return t;
}

// The moments of a data-parallel save: every rank's shard file (of this save: world size, rank,
// step count, the plan's parameters), assembled (every element exactly once), their masters
// checked against model.safetensors (c->masters, already read).
Status read_sharded_moments(const std::string& dir, TrainerCheckpoint* c) {
  const SavedShardPlan& plan = *c->shard_plan;
  const int world = static_cast<int>(c->world_size);
  std::vector<OptimizerShard> shards;
  for (int r = 0; r < world; ++r) {
    const std::string path = in_dir(dir, optimizer_shard_file(r, world).c_str());
    Result<OptimizerShard> shard = read_shard_file(path);
    if (!shard) return shard.status();
    const OptimizerShard& s = shard.value();
    if (s.world_size != world || s.rank != r)
      return Status::error(path + ": the shard of rank " + std::to_string(s.rank) + " of " +
                           std::to_string(s.world_size) + ", expected rank " + std::to_string(r) +
                           " of " + std::to_string(world));
    if (s.params != plan.params)
      return Status::error(path + ": its parameters differ from " + kTrainerStateFile +
                           "'s shard_plan (a shard of another model?)");
    if (s.steps != c->optimizer_steps)
      return Status::error(path + ": " + std::to_string(s.steps) + " optimizer steps, " +
                           kTrainerStateFile + " records " + std::to_string(c->optimizer_steps) +
                           " (a shard of another save?)");
    shards.push_back(std::move(shard).value());
  }
  Result<FullOptimizerState> full = assemble_optimizer_state(shards);
  if (!full) return Status::error(dir + ": " + full.status().message());
  const std::vector<ParamSpec> specs = model_param_specs(c->model);
  c->moments.clear();
  for (size_t p = 0; p < specs.size(); ++p) {
    const Tensor& master = c->masters.at(specs[p].name);
    const std::vector<float>& saved = full.value().master[p];
    if (master.nbytes() != saved.size() * sizeof(float) ||
        std::memcmp(master.data(), saved.data(), master.nbytes()) != 0)
      return Status::error(dir + ": the optimizer shards' master of " + specs[p].name +
                           " differs from " + io::kHfWeightsFile + " (files of different saves?)");
    c->moments.emplace(exp_avg_name(specs[p].name),
                       host_f32(full.value().exp_avg[p], specs[p].shape));
    c->moments.emplace(exp_avg_sq_name(specs[p].name),
                       host_f32(full.value().exp_avg_sq[p], specs[p].shape));
  }
  return Status::ok();
}

// ---- primary weights ----------------------------------------------------------------------------

// Host copies of one parameter's primary-weight components, downloaded once.
struct PrimaryCopy {
  const GroupedParam* param = nullptr;
  bool quantized = false;                             // a low-precision primary (else BF16)
  std::map<std::string, std::vector<uint8_t>> parts;  // weight_components name -> bytes
};

std::vector<uint8_t> slice(const std::vector<uint8_t>& v, size_t begin, size_t bytes) {
  PACKMOE_CHECK(begin + bytes <= v.size(), "primary slice out of range");
  return {v.begin() + static_cast<std::ptrdiff_t>(begin),
          v.begin() + static_cast<std::ptrdiff_t>(begin + bytes)};
}

}  // namespace

std::string exp_avg_name(const std::string& param) { return "exp_avg/" + param; }
std::string exp_avg_sq_name(const std::string& param) { return "exp_avg_sq/" + param; }

std::string optimizer_shard_file(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "optimizer-%05d-of-%05d.bin", rank, world);
  return name;
}

SavedShardPlan saved_shard_plan(const ShardPlan& plan) {
  SavedShardPlan s;
  s.total = plan.total();
  s.bucket_elems = plan.bucket_elems();
  s.params = plan.geometries();
  for (int p = 0; p < plan.params(); ++p) s.offsets.push_back(plan.slot(p).offset);
  for (int r = 0; r < plan.world_size(); ++r) s.shards.push_back(plan.shard(r));
  return s;
}

Status write_trainer_checkpoint(const std::string& dir, const TrainerCheckpoint& c) {
  PACKMOE_RETURN_IF_ERROR(save_model_config(c.model, in_dir(dir, kConfigFile), DType::kF32));
  PACKMOE_RETURN_IF_ERROR(
      io::save_hf_weights(in_dir(dir, io::kHfWeightsFile), c.model, c.masters, DType::kF32));
  if (!c.shard_plan)
    PACKMOE_RETURN_IF_ERROR(io::write_state_tensors(in_dir(dir, kOptimizerFile), c.moments));
  return io::write_json_file(in_dir(dir, kTrainerStateFile), state_json(c));
}

Status write_optimizer_shard(const std::string& dir, const OptimizerShard& shard) {
  const std::vector<uint8_t> bytes = encode_optimizer_shard(shard);
  const std::span<const uint8_t> parts[] = {bytes};
  return io::write_file_atomic(
      (fs::path(dir) / optimizer_shard_file(shard.rank, shard.world_size)).string(), parts);
}

Result<TrainerCheckpoint> read_trainer_checkpoint(const std::string& dir) {
  Result<io::CheckpointInfo> info = io::verify_checkpoint(dir);
  if (!info) return info.status();
  TrainerCheckpoint c;
  c.dir = dir;
  Result<ModelConfig> model = load_model_config(in_dir(dir, kConfigFile));
  if (!model) return model.status();
  c.model = model.value();

  const std::string state_path = in_dir(dir, kTrainerStateFile);
  Result<json> state = io::read_json_file(state_path);
  if (!state) return state.status();
  PACKMOE_RETURN_IF_ERROR(parse_state(state.value(), state_path, info.value().step, &c));

  Result<ModelWeights> masters = io::load_hf_weights(in_dir(dir, io::kHfWeightsFile), c.model);
  if (!masters) return masters.status();
  c.masters = std::move(masters.value());

  if (c.shard_plan) {
    PACKMOE_RETURN_IF_ERROR(read_sharded_moments(dir, &c));
    return c;
  }
  std::vector<io::StateTensorSpec> specs;
  for (const ParamSpec& p : model_param_specs(c.model)) {
    specs.push_back({exp_avg_name(p.name), DType::kF32, p.shape});
    specs.push_back({exp_avg_sq_name(p.name), DType::kF32, p.shape});
  }
  Result<io::StateTensors> moments = io::read_state_tensors(in_dir(dir, kOptimizerFile), specs);
  if (!moments) return moments.status();
  c.moments = std::move(moments.value());
  return c;
}

Result<std::string> find_checkpoint(const std::string& path, std::vector<std::string>* skipped) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return Status::error(path + ": no such checkpoint directory");
  if (fs::exists(fs::path(path) / io::kCheckpointMarker, ec)) return path;
  Result<io::LatestCheckpoint> latest = io::latest_checkpoint(path);
  if (!latest) return latest.status();
  if (skipped) *skipped = latest.value().skipped;
  if (!latest.value().found) {
    std::string why = path + ": no complete checkpoint (no " + io::kCheckpointMarker +
                      " here, no valid step-* directory under it)";
    if (!latest.value().skipped.empty()) why += "; " + latest.value().skipped.front();
    return Status::error(why);
  }
  return latest.value().found->dir;
}

Status write_primary_weights(const std::string& path, const Model& model) {
  std::map<std::string, PrimaryCopy> copies;
  Recipe recipe = Recipe::kBF16;
  bool mxfp8_2d = false;
  for (const NamedParam& p : model.params()) {
    PrimaryCopy& c = copies[p.name];
    c.param = p.param;
    c.quantized = p.param->recipe().recipe != Recipe::kBF16 &&
                  p.param->primary() == PrimaryWeight::kLowPrecision;
    if (c.quantized) {
      recipe = p.param->recipe().recipe;
      mxfp8_2d = p.param->recipe().mxfp8_weight_2d;
    }
    for (const NamedStorage& s : p.param->weight_components()) {
      const bool wanted =
          c.quantized ? (s.name == "row_data" || s.name == "row_scale" || s.name == "decode_scale")
                      : s.name == "bf16";
      if (wanted) c.parts[s.name] = s.storage->download();
    }
  }
  io::SafetensorsWriter out;
  out.set_metadata("format", "pt");
  if (recipe != Recipe::kBF16) {
    out.set_metadata("packmoe.format", recipe_name(recipe));
    out.set_metadata("packmoe.block",
                     recipe == Recipe::kNvfp4 ? "16x16" : (mxfp8_2d ? "32x32" : "1x32"));
  }
  for (const io::HfTensorSpec& s : io::hf_tensor_specs(model.config())) {
    const PrimaryCopy& c = copies.at(s.param);
    const int64_t n = c.param->n(), k = c.param->k();
    const int64_t numel = shape_numel(s.shape);
    const size_t o = static_cast<size_t>(s.offset), count = static_cast<size_t>(numel);
    if (!c.quantized) {
      out.add(s.hf_name, "BF16", s.shape, slice(c.parts.at("bf16"), 2 * o, 2 * count));
      continue;
    }
    // A quantized expert weight: rows [r0, r0 + rows) of expert e, K columns.
    const int64_t e = s.offset / (n * k), r0 = (s.offset % (n * k)) / k, rows = numel / k;
    const size_t first_row = static_cast<size_t>(e * n + r0);
    if (recipe == Recipe::kMxfp8) {
      const size_t scales = static_cast<size_t>(k / kMxfp8Block);
      out.add(s.hf_name, "F8_E4M3", s.shape, slice(c.parts.at("row_data"), o, count));
      out.add(s.hf_name + "_scale", "F8_E8M0", {rows, k / kMxfp8Block},
              slice(c.parts.at("row_scale"), first_row * scales, rows * scales));
    } else {
      const size_t scales = static_cast<size_t>(k / kNvfp4Block);
      out.add(s.hf_name, "U8", {rows, k / 2}, slice(c.parts.at("row_data"), o / 2, count / 2));
      out.add(s.hf_name + "_scale", "F8_E4M3", {rows, k / kNvfp4Block},
              slice(c.parts.at("row_scale"), first_row * scales, rows * scales));
      out.add(
          s.hf_name + "_scale_2", "F32", {},
          slice(c.parts.at("decode_scale"), static_cast<size_t>(e) * sizeof(float), sizeof(float)));
    }
  }
  return out.write(path);
}

Result<std::string> checkpoint_tokenizer(const std::string& checkpoint) {
  Result<std::string> dir = find_checkpoint(checkpoint, nullptr);
  if (!dir) return dir.status();
  const std::string state = in_dir(dir.value(), kTrainerStateFile);
  Result<std::string> text = io::read_regular_file(state, io::kMaxJsonFileBytes);
  if (!text) return text.status();
  Result<nlohmann::json> j = parse_json_text(text.value(), state);
  if (!j) return j.status();
  const nlohmann::json& v = j.value();
  if (!v.is_object() || !v.contains("train") || !v["train"].is_object() ||
      !v["train"].contains("tokenizer"))
    return std::string();
  if (!v["train"]["tokenizer"].is_string())
    return Status::error(state + ": train.tokenizer must be a path (got " +
                         json_brief(v["train"]["tokenizer"]) + ")");
  return v["train"]["tokenizer"].get<std::string>();
}

Result<std::string> export_hf(const std::string& checkpoint, const std::string& out_dir,
                              DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF32)
    return Status::error("export-hf writes bf16 or f32 weights");
  Result<std::string> dir = find_checkpoint(checkpoint, nullptr);
  if (!dir) return dir.status();
  PACKMOE_RETURN_IF_ERROR(io::verify_checkpoint(dir.value()).status());
  Result<ModelConfig> model = load_model_config(in_dir(dir.value(), kConfigFile));
  if (!model) return model.status();
  Result<ModelWeights> weights =
      io::load_hf_weights(in_dir(dir.value(), io::kHfWeightsFile), model.value());
  if (!weights) return weights.status();
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return Status::error(out_dir + ": cannot create the directory: " + ec.message());
  PACKMOE_RETURN_IF_ERROR(io::save_hf_weights(in_dir(out_dir, io::kHfWeightsFile), model.value(),
                                              weights.value(), dtype));
  PACKMOE_RETURN_IF_ERROR(save_model_config(model.value(), in_dir(out_dir, kConfigFile), dtype));
  return dir.value();
}

}  // namespace packmoe::train
