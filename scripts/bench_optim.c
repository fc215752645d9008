/*
 * bench_optim.c — the CPU backend's AdamW update per parameter, side by side in alternating rounds: fp32 master
 * and moments (with the bf16 copy mixed bf16 keeps), and bf16 master and moments rounded to nearest or
 * stochastically (issue 14). Built and run by scripts/bench_optim.sh against build/libamp.a.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "backend.h"
#include "sround.h"
#include "step_rule.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(void){
  struct backend *be = backend_cpu_create();
  size_t n = 1<<20; int64_t sh[1] = {(int64_t)n};
  struct tensor p32,p16,g,m32,v32,m16,v16,c16,c32; struct amp_error err;
  tensor_zeros(&p32,be,DT_FP32,1,sh,"p",&err); tensor_zeros(&p16,be,DT_BF16,1,sh,"p",&err);
  tensor_zeros(&g,be,DT_FP32,1,sh,"g",&err); tensor_zeros(&m32,be,DT_FP32,1,sh,"m",&err); tensor_zeros(&v32,be,DT_FP32,1,sh,"v",&err);
  tensor_zeros(&m16,be,DT_BF16,1,sh,"m",&err); tensor_zeros(&v16,be,DT_BF16,1,sh,"v",&err);
  tensor_zeros(&c16,be,DT_BF16,1,sh,"c",&err); tensor_zeros(&c32,be,DT_FP32,1,sh,"c",&err);
  float *gf = g.data; for (size_t i=0;i<n;i++) gf[i] = (float)((i*2654435761u)%1000)/1000.0f - 0.5f;
  struct step_params sp = {.beta1=0.9,.beta2=0.999,.weight_decay=0.01f}; struct step_scalars sc;
  step_rule_scalars(&sc,&sp,1e-3f,5,1.0f);
  struct optim_update_args base = {.grad=&g,.sc=&sc,.weight_decay=0.01f,.beta1=0.9,.beta2=0.999,.eps=1e-8f,.sr_seed=sr_seed(1)};
  const char *names[] = {"fp32 master+state, bf16 copy", "bf16 master+state, nearest", "bf16 master+state, stochastic"};
  for (int round=0; round<3; round++) for (int k=0;k<3;k++){
    struct optim_update_args a = base;
    if (k==0){a.master=&p32;a.m=&m32;a.v=&v32;a.copy=&c16;} else {a.master=&p16;a.m=&m16;a.v=&v16;a.copy=NULL;a.stochastic=k==2;}
    double t0=now(); for(int it=0;it<20;it++) be->adamw_update(be,&a,1); double dt=(now()-t0)/20;
    printf("round %d %-32s %.2f ms per update of 1M params (%.2f ns/param)\n", round, names[k], dt*1e3, dt*1e9/n);
  }
  return 0;
}
