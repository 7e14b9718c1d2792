set -u
export NCCL_NVLS_ENABLE=0
cmake -S . -B build-gpu -G Ninja -DPACKMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 > $OUT/build.log 2>&1 && cmake --build build-gpu -j 16 >> $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built $(date +%T)"
(cd build-gpu && ctest -L cuda -j 4 --timeout 300 > $OUT/tests.log 2>&1; grep -E "tests passed|tests failed|Failed|\*\*\*" $OUT/tests.log | head; grep -E "mismatches=[1-9]" $OUT/tests.log | head -3; echo "cuda==cpu ok lines: $(grep -cE 'mismatches=0$' $OUT/tests.log)")
build-gpu/cuda_test_nccl_dist_optimizer --gtest_filter='*StartUp*' 2>&1 | grep -E "OK \]|FAILED \]|reserved" | head -3
build-gpu/cuda_test_nccl_ep_moe_block 2>&1 | grep -E "OK \]|FAILED \]|PASSED|dist\]" | head -8
sed -i 's/^  be_->release_unused_memory();$/  \/\/ removed/' src/dist/dist_optimizer.cpp
cmake --build build-gpu -j 16 --target cuda_test_nccl_dist_optimizer >> $OUT/build.log 2>&1
echo "break check (expect FAILED):"; build-gpu/cuda_test_nccl_dist_optimizer --gtest_filter='*StartUp*' 2>&1 | grep -E "OK \]|FAILED \]|reserved" | head -3
git checkout src/dist/dist_optimizer.cpp 2>/dev/null || sed -i 's/^  \/\/ removed$/  be_->release_unused_memory();/' src/dist/dist_optimizer.cpp
grep -c "be_->release_unused_memory();" src/dist/dist_optimizer.cpp
cmake --build build-gpu -j 16 >> $OUT/build.log 2>&1
echo "step $(date +%T)"
scripts/gpu-step.sh --presets "qwen3_30b_a3b_layers small" --grad-accum "1 8" --recipes "bf16 mxfp8 nvfp4" --peer compile > $OUT/step_stdout.txt 2>&1
tail -14 $OUT/step_stdout.txt
