// TrainConfig checks, precision names and the "train" JSON object.
#include "train/train_config.h"

#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/checked_math.h"
#include "core/json_limits.h"
#include "train/model_config.h"

namespace packmoe::train {
namespace {

using nlohmann::json;

Status at_least(const char* name, int64_t v, int64_t lo) {
  if (v >= lo) return Status::ok();
  return Status::error(std::string(name) + " = " + std::to_string(v) + " must be >= " +
                       std::to_string(lo));
}

// [lo, 2^bits].
Status in_int_range(const char* name, int64_t v, int64_t lo, int bits) {
  PACKMOE_RETURN_IF_ERROR(at_least(name, v, lo));
  if (v <= (int64_t{1} << bits)) return Status::ok();
  return Status::error(std::string(name) + " = " + std::to_string(v) + " must be at most 2^" +
                       std::to_string(bits));
}

Status in_range(const char* name, double v, double lo, double hi, const char* range) {
  if (v >= lo && v <= hi) return Status::ok();  // NaN fails
  std::ostringstream e;
  e << name << " = " << v << " must be in " << range;
  return Status::error(e.str());
}

Status type_error(const std::string& key, const char* want, const json& v) {
  return Status::error("train." + key + " must be " + want + " (got " + json_brief(v) + ")");
}

Status read(const std::string& key, const json& v, int64_t* out) {
  if (!v.is_number_integer()) return type_error(key, "an integer", v);
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX})
    return type_error(key, "at most 2^63 - 1", v);
  *out = v.get<int64_t>();
  return Status::ok();
}

Status read(const std::string& key, const json& v, uint64_t* out) {
  if (!v.is_number_unsigned())  // nlohmann parses every non-negative integer as unsigned
    return type_error(key, "a non-negative integer", v);
  *out = v.get<uint64_t>();
  return Status::ok();
}

Status read(const std::string& key, const json& v, double* out) {
  if (!v.is_number()) return type_error(key, "a number", v);
  *out = v.get<double>();
  return Status::ok();
}

Status read(const std::string& key, const json& v, bool* out) {
  if (!v.is_boolean()) return type_error(key, "true or false", v);
  *out = v.get<bool>();
  return Status::ok();
}

Status read_name(const std::string& key, const json& v, std::string* out) {
  if (!v.is_string()) return type_error(key, "a string", v);
  *out = v.get<std::string>();
  return Status::ok();
}

}  // namespace

Status validate(const TrainConfig& c, const ModelConfig& model) {
  PACKMOE_RETURN_IF_ERROR(in_int_range("steps", c.steps, 1, kMaxStepsBits));
  PACKMOE_RETURN_IF_ERROR(in_int_range("micro_batch_size", c.micro_batch_size, 1, kMaxRowsBits));
  PACKMOE_RETURN_IF_ERROR(at_least("seq_len", c.seq_len, 1));
  if (c.seq_len > model.max_position_embeddings)
    return Status::error("seq_len = " + std::to_string(c.seq_len) +
                         " exceeds the model's max_position_embeddings = " +
                         std::to_string(model.max_position_embeddings));
  PACKMOE_RETURN_IF_ERROR(in_int_range("grad_accum_steps", c.grad_accum_steps, 1, kMaxAccumBits));
  if (c.expert_parallel < 1 || c.expert_parallel > kMaxRanks)
    return Status::error("expert_parallel = " + std::to_string(c.expert_parallel) +
                         " must be in [1, " + std::to_string(kMaxRanks) + "]");
  if (c.dispatch_dtype == DispatchDtype::kRecipe && c.precision.recipe.recipe == Recipe::kBF16)
    return Status::error("dispatch_dtype = recipe needs the mxfp8 or nvfp4 recipe (bf16 rows "
                         "already travel as the FC1 GEMM reads them)");
  if (c.dispatch_dtype == DispatchDtype::kRecipe && c.expert_parallel == 1)
    return Status::error("dispatch_dtype = recipe needs expert parallelism (expert_parallel > 1): "
                         "with every expert on its rank no row is dispatched");
  // Token counts are exact: a micro-batch, a step and the whole run (the data position) in int64.
  const std::optional<int64_t> rows_tokens = checked_mul(c.micro_batch_size, c.seq_len);
  if (!rows_tokens || *rows_tokens > (int64_t{1} << kMaxRowsBits))
    return Status::error("micro_batch_size x seq_len = " + std::to_string(c.micro_batch_size) +
                         " x " + std::to_string(c.seq_len) + " tokens must be at most 2^" +
                         std::to_string(kMaxRowsBits) + " per micro-batch");
  if (!checked_product({*rows_tokens, c.grad_accum_steps, c.steps, kMaxRanks}))
    return Status::error("steps x grad_accum_steps x micro_batch_size x seq_len = " +
                         std::to_string(c.steps) + " x " + std::to_string(c.grad_accum_steps) +
                         " x " + std::to_string(*rows_tokens) +
                         " tokens overflows the run's 64-bit token count");
  PACKMOE_RETURN_IF_ERROR(in_int_range("warmup_steps", c.warmup_steps, 0, kMaxStepsBits));
  if (c.decay_steps)
    PACKMOE_RETURN_IF_ERROR(in_int_range("decay_steps", *c.decay_steps, 1, kMaxStepsBits));
  PACKMOE_RETURN_IF_ERROR(validate(lr_schedule(c)));
  PACKMOE_RETURN_IF_ERROR(in_range("weight_decay", c.weight_decay, 0, 1e9, "[0, 1e9]"));
  PACKMOE_RETURN_IF_ERROR(in_range("beta1", c.beta1, 0, std::nextafter(1.0, 0.0), "[0, 1)"));
  PACKMOE_RETURN_IF_ERROR(in_range("beta2", c.beta2, 0, std::nextafter(1.0, 0.0), "[0, 1)"));
  PACKMOE_RETURN_IF_ERROR(in_range("eps", c.eps, 1e-30, 1.0, "[1e-30, 1]"));
  if (!std::isfinite(c.grad_clip))
    return Status::error("grad_clip must be a finite number (<= 0 disables clipping)");
  PACKMOE_RETURN_IF_ERROR(in_int_range("eval_interval", c.eval_interval, 0, kMaxStepsBits));
  if (c.eval_interval > 0)
    PACKMOE_RETURN_IF_ERROR(in_int_range("eval_batches", c.eval_batches, 1, kMaxAccumBits));
  PACKMOE_RETURN_IF_ERROR(in_int_range("log_interval", c.log_interval, 1, kMaxStepsBits));
  PACKMOE_RETURN_IF_ERROR(in_range("valid_fraction", c.valid_fraction, 0,
                                   std::nextafter(1.0, 0.0), "[0, 1)"));
  // NVFP4 gradient SR numbers each micro-batch's draws by its step and place in the step
  // (nvfp4_grad_sr_offset).
  if (c.precision.recipe.recipe == Recipe::kNvfp4) {
    if (c.steps >= (int64_t{1} << kSrStepBits))
      return Status::error("NVFP4: steps must be below 2^" + std::to_string(kSrStepBits) +
                           " (its stochastic rounding numbers the steps' draws)");
    if (c.grad_accum_steps > (int64_t{1} << kSrIndexBits))
      return Status::error("NVFP4: grad_accum_steps must be at most 2^" +
                           std::to_string(kSrIndexBits) +
                           " (its stochastic rounding numbers the micro-batches of a step)");
  }
  return Status::ok();
}

Status check_step_count(const std::string& name, int64_t value) {
  return in_int_range(name.c_str(), value, 0, kMaxStepsBits);
}

Status check_run_fits(const TrainConfig& c, const ModelConfig& m, int64_t bytes_available) {
  PACKMOE_RETURN_IF_ERROR(check_model_fits(m, bytes_available));
  // A micro-batch's activations, at least: FP32 logits and their gradient (2 V per token) and one
  // hidden state per layer and token.
  const std::optional<int64_t> per_token = checked_add(
      checked_mul(2, m.vocab_size).value_or(-1),
      checked_mul(m.num_hidden_layers, m.hidden_size).value_or(-1));
  const std::optional<int64_t> activations =
      per_token ? checked_product({c.micro_batch_size, c.seq_len, *per_token, 4}) : std::nullopt;
  const int64_t model_bytes =
      checked_mul(parameter_count(m).total, kBytesPerParameter).value_or(-1);
  const std::optional<int64_t> total =
      activations ? checked_add(*activations, model_bytes) : std::nullopt;
  return check_fits(total, bytes_available,
                    "a micro-batch of " + std::to_string(c.micro_batch_size) + " x " +
                        std::to_string(c.seq_len) + " tokens (activations, with the model)");
}

LrSchedule lr_schedule(const TrainConfig& c) {
  return LrSchedule{c.lr, c.min_lr, c.warmup_steps, c.decay_steps.value_or(c.steps)};
}

Result<Recipe> parse_recipe(const std::string& name) {
  for (Recipe r : {Recipe::kBF16, Recipe::kMxfp8, Recipe::kNvfp4})
    if (name == recipe_name(r)) return r;
  return Status::error("recipe must be bf16, mxfp8 or nvfp4 (got '" + name + "')");
}

const char* layout_name(Layout layout) {
  return layout == Layout::kSingle ? "single" : "discrete";
}

Result<Layout> parse_layout(const std::string& name) {
  for (Layout l : {Layout::kSingle, Layout::kDiscrete})
    if (name == layout_name(l)) return l;
  return Status::error("layout must be single or discrete (got '" + name + "')");
}

const char* primary_name(PrimaryWeight primary) {
  return primary == PrimaryWeight::kLowPrecision ? "low" : "high";
}

Result<PrimaryWeight> parse_primary(const std::string& name) {
  for (PrimaryWeight p : {PrimaryWeight::kLowPrecision, PrimaryWeight::kHighPrecision})
    if (name == primary_name(p)) return p;
  return Status::error("primary must be low or high (got '" + name + "')");
}

const char* recompute_name(Recompute recompute) {
  switch (recompute) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

Result<Recompute> parse_recompute(const std::string& name) {
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
    if (name == recompute_name(r)) return r;
  return Status::error("recompute must be none, selective or full (got '" + name + "')");
}

Result<DispatchDtype> parse_dispatch_dtype(const std::string& name) {
  for (DispatchDtype d : {DispatchDtype::kBF16, DispatchDtype::kRecipe})
    if (name == dispatch_dtype_name(d)) return d;
  return Status::error("dispatch_dtype must be bf16 or recipe (got '" + name + "')");
}

json train_config_to_json(const TrainConfig& c) {
  json j;
  j["steps"] = c.steps;
  j["micro_batch_size"] = c.micro_batch_size;
  j["seq_len"] = c.seq_len;
  j["grad_accum_steps"] = c.grad_accum_steps;
  j["lr"] = c.lr;
  j["min_lr"] = c.min_lr;
  j["warmup_steps"] = c.warmup_steps;
  if (c.decay_steps) j["decay_steps"] = *c.decay_steps;
  j["weight_decay"] = c.weight_decay;
  j["beta1"] = c.beta1;
  j["beta2"] = c.beta2;
  j["eps"] = c.eps;
  j["grad_clip"] = c.grad_clip;
  j["eval_interval"] = c.eval_interval;
  j["eval_batches"] = c.eval_batches;
  j["log_interval"] = c.log_interval;
  j["seed"] = c.seed;
  j["shuffle"] = c.shuffle;
  j["valid_fraction"] = c.valid_fraction;
  j["recipe"] = recipe_name(c.precision.recipe.recipe);
  j["layout"] = layout_name(c.precision.layout);
  j["primary"] = primary_name(c.precision.primary);
  j["gather_mode"] = gather_mode_name(c.gather_mode);
  j["expert_parallel"] = c.expert_parallel;
  j["dispatch_dtype"] = dispatch_dtype_name(c.dispatch_dtype);
  j["recompute"] = recompute_name(c.recompute);
  if (!c.tokenizer.empty()) j["tokenizer"] = c.tokenizer;
  return j;
}

Status apply_train_json(const json& j, TrainConfig* c) {
  if (!j.is_object())
    return Status::error("\"train\" must be a JSON object (got " + json_brief(j) + ")");
  for (const auto& [key, v] : j.items()) {
    if (key == "steps") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->steps));
    } else if (key == "micro_batch_size") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->micro_batch_size));
    } else if (key == "seq_len") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->seq_len));
    } else if (key == "grad_accum_steps") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->grad_accum_steps));
    } else if (key == "expert_parallel") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->expert_parallel));
    } else if (key == "lr") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->lr));
    } else if (key == "min_lr") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->min_lr));
    } else if (key == "warmup_steps") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->warmup_steps));
    } else if (key == "decay_steps") {
      int64_t d = 0;
      PACKMOE_RETURN_IF_ERROR(read(key, v, &d));
      c->decay_steps = d;
    } else if (key == "weight_decay") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->weight_decay));
    } else if (key == "beta1") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->beta1));
    } else if (key == "beta2") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->beta2));
    } else if (key == "eps") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->eps));
    } else if (key == "grad_clip") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->grad_clip));
    } else if (key == "eval_interval") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->eval_interval));
    } else if (key == "eval_batches") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->eval_batches));
    } else if (key == "log_interval") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->log_interval));
    } else if (key == "seed") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->seed));
    } else if (key == "shuffle") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->shuffle));
    } else if (key == "valid_fraction") {
      PACKMOE_RETURN_IF_ERROR(read(key, v, &c->valid_fraction));
    } else if (key == "tokenizer") {
      if (!v.is_string()) return type_error(key, "a path", v);
      c->tokenizer = v.get<std::string>();
    } else if (key == "gather_mode") {
      std::string name;
      PACKMOE_RETURN_IF_ERROR(read_name(key, v, &name));
      Result<GatherMode> m = parse_gather_mode(name);
      if (!m) return m.status();
      c->gather_mode = m.value();
    } else if (key == "dispatch_dtype") {
      std::string name;
      PACKMOE_RETURN_IF_ERROR(read_name(key, v, &name));
      Result<DispatchDtype> d = parse_dispatch_dtype(name);
      if (!d) return d.status();
      c->dispatch_dtype = d.value();
    } else if (key == "recompute") {
      std::string name;
      PACKMOE_RETURN_IF_ERROR(read_name(key, v, &name));
      Result<Recompute> r = parse_recompute(name);
      if (!r) return r.status();
      c->recompute = r.value();
    } else if (key == "recipe" || key == "layout" || key == "primary") {
      std::string name;
      PACKMOE_RETURN_IF_ERROR(read_name(key, v, &name));
      if (key == "recipe") {
        Result<Recipe> r = parse_recipe(name);
        if (!r) return r.status();
        c->precision.recipe.recipe = r.value();
      } else if (key == "layout") {
        Result<Layout> l = parse_layout(name);
        if (!l) return l.status();
        c->precision.layout = l.value();
      } else {
        Result<PrimaryWeight> p = parse_primary(name);
        if (!p) return p.status();
        c->precision.primary = p.value();
      }
    } else {
      return Status::error("unknown key train." + key);
    }
  }
  return Status::ok();
}

}  // namespace packmoe::train
