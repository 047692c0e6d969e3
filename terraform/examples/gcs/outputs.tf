output "checkpoint_uri_prefix" {
  description = "Prefix of the run URIs for the training config's cloudckpt.uri."
  value       = module.checkpoints.checkpoint_uri_prefix
}

output "service_account_email" {
  description = "For deploy/k8s/overlays/gke/serviceaccount-workload-identity.yaml (iam.gke.io/gcp-service-account)."
  value       = module.checkpoints.service_account_email
}
