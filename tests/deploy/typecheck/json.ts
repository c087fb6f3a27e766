/**
 * Types of the chart's JSON/YAML objects for `tsc --noEmit --strict` (test_monitoring.py writes
 * each rendered object as `const x: <Type> = <object literal>;` next to this file and compiles).
 * Object literals get excess-property checks, so an unknown field fails as well as a wrong type.
 */
import type { Dashboard } from '@grafana/schema';
import type { IPodMonitor } from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor';
import type { IPrometheusRule } from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule';
import type { IServiceMonitor } from '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor';

/** T as written in JSON: a string enum is its string values (Grafana's schema uses TS enums). */
export type Json<T> =
  T extends string ? `${T}` :
  T extends number | boolean | null | undefined ? T :
  T extends ReadonlyArray<infer U> ? Array<Json<U>> :
  T extends object ? { [K in keyof T]: Json<T[K]> } :
  T;

export type DashboardJson = Json<Dashboard>;
export type ServiceMonitorJson = Json<IServiceMonitor>;
export type PodMonitorJson = Json<IPodMonitor>;
export type PrometheusRuleJson = Json<IPrometheusRule>;
