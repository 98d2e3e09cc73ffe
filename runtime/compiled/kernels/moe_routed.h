// The routed experts of an MoE layer for the few rows of a decode or verify step, for small_linear.cpp:
// each expert some row chose runs on those rows only, so a decode reads its top-k experts' weights and
// a verify the union over its rows, where the compiled graph's branch-free form read all E (a real MoE
// target has 128-512 experts). Each expert's products are small_linear's (a row's result does not
// depend on the call's row count), and each row's expert outputs are added in fp32 in ascending
// expert order, as the eager loop's index_add_ does, so a verify's row equals a decode's.
// x [N, H]; index [N, k] (int64, the router's choice); weights [N, k] (fp32); up [E, I, H];
// down [E, H, I]; act: kActivations' index; form: small_linear's Form. Returns [N, H] in x's dtype.
// Included inside small_linear.cpp's anonymous namespace, after product().

// The activations an MoE expert may apply between its two products (torch_backend's names, in order).
constexpr const char* kActivations[] = {"relu2", "relu", "silu", "gelu"};

// Per row count 1..kCountedRows (the rest in the last slot): calls, and experts run by them (a cost
// report's "experts read per step": a decode reads top-k, a verify the union over its rows).
constexpr int64_t kCountedRows = 48;
std::atomic<int64_t> moe_calls[kCountedRows + 1], moe_experts[kCountedRows + 1];

at::Tensor activation(const at::Tensor& h, int64_t act) {
  switch (act) {
    case 0: return at::square(at::relu(h));
    case 1: return at::relu(h);
    case 2: return at::silu(h);
    default: return at::gelu(h);
  }
}

at::Tensor moe_routed(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                      const at::Tensor& up, const at::Tensor& down, int64_t act, int64_t form) {
  TORCH_CHECK(up.dim() == 3 && down.dim() == 3 && up.size(0) == down.size(0) && up.size(1) == down.size(2) &&
                  up.size(2) == down.size(1),
              "nemospec::moe_routed: expected up [E, I, H] and down [E, H, I]");
  TORCH_CHECK(act >= 0 && act < static_cast<int64_t>(std::size(kActivations)),
              "nemospec::moe_routed: activation ", act, " is not one of relu2, relu, silu, gelu");
  TORCH_CHECK(form >= 0 && form <= static_cast<int64_t>(Form::kBf16Products), "nemospec::moe_routed: form ", form);
  const int64_t E = up.size(0), H = up.size(2);
  TORCH_CHECK(x.size(-1) == H, "nemospec::moe_routed: x has ", x.size(-1), " features, the experts expect ", H);
  const at::Tensor xc = x.reshape({-1, H}).contiguous();
  const int64_t N = xc.size(0);
  TORCH_CHECK(index.numel() == weights.numel() && N && index.numel() % N == 0,
              "nemospec::moe_routed: index and weights must be [N, k] for x's N = ", N, " rows");
  const at::Tensor idx = index.reshape({N, -1}).to(at::kLong).contiguous();
  const at::Tensor wts = weights.reshape({N, -1}).to(at::kFloat).contiguous();
  const int64_t top_k = idx.size(1);
  const int64_t* ip = idx.const_data_ptr<int64_t>();
  const float* wp = wts.const_data_ptr<float>();
  at::Tensor out = at::zeros({N, H}, xc.options().dtype(at::kFloat));
  float* op = out.mutable_data_ptr<float>();
  std::vector<int64_t> rows;
  std::vector<float> scale;
  int64_t experts = 0;
  for (int64_t e = 0; e < E; ++e) {
    rows.clear();
    scale.clear();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < top_k; ++s)
        if (ip[n * top_k + s] == e) {
          rows.push_back(n);
          scale.push_back(wp[n * top_k + s]);
        }
    if (rows.empty()) continue;
    ++experts;
    const int64_t R = static_cast<int64_t>(rows.size());
    const at::Tensor chosen = at::from_blob(rows.data(), {R}, at::kLong);
    const at::Tensor h = activation(product(xc.index_select(0, chosen), up[e], static_cast<Form>(form)), act);
    const at::Tensor y = product(h, down[e], static_cast<Form>(form)).to(at::kFloat).contiguous();
    const float* yp = y.const_data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) {
      float* dst = op + rows[r] * H;
      const float* src = yp + r * H;
      for (int64_t c = 0; c < H; ++c) dst[c] += src[c] * scale[r];
    }
  }
  moe_calls[std::min(N, kCountedRows)] += 1;
  moe_experts[std::min(N, kCountedRows)] += experts;
  return out.to(x.scalar_type()).reshape(x.sizes());
}

// [2, kCountedRows + 1] int64: calls and experts run, per row count (slot 0 unused).
at::Tensor moe_routed_counts() {
  at::Tensor out = at::zeros({2, kCountedRows + 1}, at::kLong);
  int64_t* p = out.mutable_data_ptr<int64_t>();
  for (int64_t n = 0; n <= kCountedRows; ++n) {
    p[n] = moe_calls[n].load();
    p[kCountedRows + 1 + n] = moe_experts[n].load();
  }
  return out;
}
